"""End to end through the ``phalanx`` command, on the embedded digits data.

The default run, a refusal and the progress bar on a terminal go through the installed command; the other runs
and refusals through the command's own ``main()`` in this process (the same parsing, checks, messages and exit
status, without a second of interpreter start-up each).
"""

import json
import re
import subprocess

import pytest
import torch

from helpers import only_run, run_cli, run_in_process, run_main
from phalanx import config_file
from phalanx.cli import build_parser, config_from_args
from phalanx.checkpoint import list_checkpoints


@pytest.mark.slow
def test_default_train_reaches_the_accuracy_and_reports(tmp_path):
    out = run_cli("train", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("phalanx train: strategy sync (DDP), world size 2, devices cpu, backend gloo, "
                               "global batch 64")
    steps = [ln for ln in lines if re.fullmatch(r"step \d+, loss = \d+\.\d\d \(\d+\.\d examples/sec; "
                                                r"\d+\.\d{3} sec/batch\)", ln)]
    assert len(steps) == 15  # every 20 of 300 steps, printed once (rank 0 alone prints)
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", out.stdout).group(1))
    assert accuracy >= 0.95
    assert re.search(r"throughput \d+\.\d examples/sec \(global\)", out.stdout)
    assert "checkpoint runs/sync-1/step-00000300.pt" in out.stdout  # a directory of its own
    assert re.search(r"wall time \d+\.\d s", out.stdout)
    state = torch.load(only_run(tmp_path) / "step-00000300.pt", weights_only=True)
    assert state["step"] == 300
    events = [json.loads(ln) for ln in (only_run(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "summary" and events[-1]["test_accuracy"] == pytest.approx(accuracy, abs=1e-4)


@pytest.mark.slow
def test_a_run_from_a_config_file_with_flags_over_it_is_saved_and_repeats(tmp_path):
    (tmp_path / "m").mkdir()  # a metrics directory must exist (a typo in it is refused, not created)
    (tmp_path / "run.toml").write_text('[model_and_data]\nmodel = "mlp"\n[optimisation]\nsteps = 60\n'
                                       'lr-schedule = "cosine"\nwarmup_steps = 5\nlr = 0.5\n'
                                       '[observation_and_checkpoints]\neval_every = 30\n')
    out = run_in_process("train", "--config", "run.toml", "--lr", "0.05", "--workers", "2", "--metrics",
                         "m/run.jsonl", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "step 30, test accuracy " in out.stdout
    events = [json.loads(ln) for ln in (tmp_path / "m" / "run.jsonl").read_text().splitlines()]
    lrs = [e["lr"] for e in events if e["event"] == "step"]
    assert lrs[0] > lrs[-1]  # cosine decays
    assert max(lrs) <= 0.05  # the flag typed over the file's lr
    saved = only_run(tmp_path) / "config.toml"
    assert f"config {saved.relative_to(tmp_path)} (--config of it repeats this run)" in out.stdout
    text = saved.read_text()
    for line in ('model = "mlp"', "lr = 0.05", 'lr_schedule = "cosine"', "workers = 2", 'metrics = "m/run.jsonl"'):
        assert line in text.splitlines(), (line, text)
    args = build_parser().parse_args(["train", "--config", str(saved)])
    config_file.apply(args.config, args.command_parser, args)
    assert config_from_args(args).resolved().to_toml() == text  # --config of the saved run is this run


@pytest.mark.slow
def test_a_saved_run_given_back_runs_again_in_a_directory_of_its_own(tmp_path):
    """The paths phalanx chose are not the run: --config of its saved file is the same run again in the next
    runs/ directory (not a refusal over the first one's checkpoints), and a --checkpoint-dir typed over it takes
    the metrics file along."""
    first = run_in_process("train", "--model", "mlp", "--steps", "5", "--workers", "1", "--progress", "none",
                           cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "runs" / "sync-1" / "config.toml"
    text = saved.read_text()
    assert not [line for line in text.splitlines() if line.startswith(("checkpoint_dir", "metrics"))], text
    again = run_in_process("train", "--config", str(saved), "--progress", "none", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "runs" / "sync-2" / "config.toml").read_text() == text
    assert final_line(again.stdout) == final_line(first.stdout)  # the same run, the same numbers
    moved = run_in_process("train", "--config", str(saved), "--checkpoint-dir", "mine", cwd=tmp_path)
    assert moved.returncode == 0, moved.stderr
    assert final_line(moved.stdout) == final_line(first.stdout)
    assert (tmp_path / "mine" / "metrics.jsonl").is_file()
    kept = (tmp_path / "mine" / "config.toml").read_text().splitlines()
    assert sorted(kept) == sorted(text.splitlines() + ['checkpoint_dir = "mine"'])  # the path the user typed


def final_line(printed: str) -> str:
    return next(line for line in printed.splitlines() if line.startswith("test accuracy"))


BAD_INPUTS = [
    (["--devices", "tpu"], "unknown device 'tpu'"),
    (["--model", "resnet9000"], "unknown model 'resnet9000': choose one of cnn, mlp, cifar10, lstm"),
    (["--devices", "cuda:3", "--strict-devices"], "cuda:3 requested but no CUDA device exists here"),
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--steps", "-5"], "--steps must be a positive integer, got -5"),
    (["--data", "cifar10", "--data-dir", "nowhere"], "CIFAR-10 files missing in nowhere: data_batch_1.bin"),
    (["--strategy", "magic"], "unknown strategy 'magic'"),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", BAD_INPUTS, ids=[f[1][:24] for f in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(tmp_path, flags, message, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["train", *flags], capsys)
    assert code == 2 and out.out == "", out
    errors = [ln for ln in out.err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], out.err
    assert "Traceback" not in out.err
    assert not (tmp_path / "runs").exists()  # no partial files left behind


@pytest.mark.slow
def test_unwritable_checkpoint_directory(tmp_path):
    """Through the installed command: its exit status and stderr, not only main()'s."""
    (tmp_path / "afile").write_text("not a directory")
    out = run_cli("train", "--checkpoint-dir", "afile/ckpt", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert "error: cannot write checkpoints to afile/ckpt" in out.stderr
    assert "choose another --checkpoint-dir" in out.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    out = run_in_process("train", "--steps", "20", "--checkpoint-every", "10", cwd=root)
    assert out.returncode == 0, out.stderr
    return root


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.slow
def test_corrupt_checkpoint_on_resume(trained, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "step-00000010.pt"
    bad.write_bytes(b"\x00garbage" * 100)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["train", "--steps", "40", "--resume", str(bad), "--checkpoint-dir", str(tmp_path)], capsys)
    assert code == 2
    assert "is corrupt or not a phalanx checkpoint" in out.err and "resume from an earlier step-*.pt" in out.err
    assert _snapshot(tmp_path) == before  # the user's files are untouched


@pytest.mark.parametrize("flags, message", [
    (["--model", "mlp"], "written with model = 'cnn' but this run has 'mlp'"),
    (["--data", "synthetic"], "written with data = 'digits' but this run has 'synthetic'"),
    (["--steps", "20"], "already at step 20 and --steps is 20"),
])
def test_mismatched_checkpoint_on_resume(trained, flags, message, capsys, monkeypatch):
    before = _snapshot(only_run(trained))
    monkeypatch.chdir(trained)
    code, out = run_main(["train", "--resume", *flags] if "--steps" in flags else
                         ["train", "--steps", "40", "--resume", *flags], capsys)
    assert code == 2, out.err
    assert message in out.err
    assert _snapshot(only_run(trained)) == before


@pytest.mark.slow
def test_resume_from_directory_continues(trained, tmp_path):
    import shutil

    shutil.copytree(trained / "runs", tmp_path / "runs")
    out = run_in_process("train", "--steps", "30", "--resume", cwd=tmp_path)  # alone: the newest run's newest
    assert out.returncode == 0, out.stderr
    assert "resuming at step 20" in out.stdout.splitlines()[0]
    assert [p.name for p in list_checkpoints(only_run(tmp_path))][-1] == "step-00000030.pt"


@pytest.mark.slow
def test_progress_bar_on_a_terminal_plain_lines_otherwise(tmp_path):
    """On a terminal (a pseudo-terminal here) rank 0 draws a bar; piped output has none."""
    import fcntl
    import os
    import struct
    import termios

    from helpers import phalanx_cmd

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(phalanx_cmd() + ["train", "--steps", "200", "--model", "mlp", "--workers", "1"],
                            cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the terminal closed: the command ended
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(master)
    screen = b"".join(chunks).decode(errors="replace")
    assert re.search(r"\d+/200 \[", screen), screen[-2000:]  # the bar: "57/200 [00:01<...]"
    assert "step 200, loss = " in screen

    # (output to files, as piped; a directory of its own: the first run's holds that run)
    piped = run_in_process("train", "--steps", "40", "--model", "mlp", "--workers", "1", "--checkpoint-dir", "piped",
                           cwd=tmp_path)
    assert piped.returncode == 0 and "/40 [" not in piped.stdout + piped.stderr
