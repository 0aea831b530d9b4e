"""A run described in a TOML file (``--config``): read as the flags are read, flags win, a saved run repeats.

Nothing here starts a worker: the file is applied to the parsed command line and the resulting TrainConfig
(or compare's options) is compared with the one the same flags make. The saved ``config.toml`` of a real run
is checked in ``test_cli.py`` (its run through ``--config``).
"""

from __future__ import annotations

import pytest

from helpers import run_main
from phalanx import config_file
from phalanx.cli import build_parser, config_from_args
from phalanx.errors import PhalanxError
from phalanx.train import TrainConfig


def _from_command_line(*argv: str):
    args = build_parser().parse_args(list(argv))
    if args.config is not None:
        config_file.apply(args.config, args.command_parser, args)
    return args


def _config(*argv: str) -> TrainConfig:
    return config_from_args(_from_command_line("train", *argv))


RUNS = [
    (),
    ("--strategy", "diloco", "--sync-every", "4", "--outer-lr", "0.5", "--straggler", "1:2", "--workers", "3"),
    ("--model", "mlp", "--optimizer", "adam", "--lr", "0.003", "--lr-schedule", "exponential", "--lr-decay-every",
     "50", "--staircase", "--clip-grad-norm", "1.0", "--no-async-checkpoint"),
    ("--data", "synthetic", "--synthetic-shape", "3x16x16", "--strategy", "fsdp", "--steps", "7",
     "--checkpoint-dir", "a dir/with \"quotes\"", "--stop-at", "accuracy>=0.9", "--eval-every", "5"),
]


@pytest.mark.parametrize("argv", RUNS, ids=["defaults", "diloco", "exponential", "synthetic"])
def test_a_saved_run_read_back_is_the_same_run(tmp_path, argv):
    typed = _config(*argv).resolved()
    saved = tmp_path / "config.toml"
    config_file.write(saved, typed.to_toml())
    again = _config("--config", str(saved)).resolved()
    assert again.to_toml() == typed.to_toml()
    assert again.strategy == typed.strategy
    assert (saved.stat().st_mode & 0o777) == 0o600  # a run's files are its owner's


def test_tables_only_group_and_a_flag_typed_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('workers = 3\n[optimisation]\nlr = 0.2\nbatch-size = 16\n'
                    '[diloco]\nstrategy = "diloco"\nsync_every = 6\ncompile = true\n')
    cfg = _config("--config", str(path), "--lr", "0.01", "--no-compile")
    assert (cfg.workers, cfg.batch_size, cfg.lr, cfg.compile) == (3, 16, 0.01, False)
    assert cfg.strategy.name == "diloco" and cfg.strategy.sync_every == 6


def test_compare_reads_its_own_flags_from_a_file(tmp_path):
    path = tmp_path / "cmp.toml"
    path.write_text('strategies = "sync,local-sgd:4"\ntarget = "loss<=0.3"\nrepeats = 2\n'
                    '[simulation]\nsimulate = true\nworkers = [8, 64]\n')
    args = _from_command_line("compare", "--config", str(path), "--repeats", "5")
    assert (args.strategies, args.repeats, args.simulate, args.workers) == ("sync,local-sgd:4", 5, True, (8, 64))


BAD_FILES = [
    ("lr = 0.1\nbatch_sise = 4\n", "batch_sise is not an option of phalanx train (did you mean batch_size"),
    ("[optimisation]\nsteps = true\n", "[optimisation] steps = true: this flag takes a value, not true or false"),
    ("compile = 1\n", "compile = 1: this flag is on or off, so write true or false"),
    ("steps = 'many'\n", "steps = 'many': --steps takes a whole number, got 'many'"),
    ("steps = 3\n[x]\nsteps = 4\n", "sets steps twice (steps and [x] steps)"),
    ("lr = \n", "is not valid TOML"),
    ("[a]\n[a.b]\nlr = 1\n", "[a.b] nests a table in a table"),
]


@pytest.mark.parametrize("text, message", BAD_FILES, ids=[m[:20] for _, m in BAD_FILES])
def test_a_bad_file_is_one_line_naming_what_to_fix(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, out = run_main(["train", "--config", str(path)], capsys)
    assert code == 2
    assert message in out.err and len(out.err.strip().splitlines()) == 1, out.err


def test_a_missing_file_or_a_directory_is_named(tmp_path):
    with pytest.raises(PhalanxError, match="does not exist; pass a TOML file"):
        config_file.read(tmp_path / "nothing.toml")
    with pytest.raises(PhalanxError, match="is a directory; pass its config.toml"):
        config_file.read(tmp_path)
