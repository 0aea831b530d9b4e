"""Fast starts: workers forked by the fork server, the parent's imports, the start-up profile.

Real processes: the fork server is multiprocessing's own, the workers real gloo ranks.
"""

import gc
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import REPO, phalanx_cmd, run_in_process, run_main, run_workers
from phalanx.checkpoint import load_checkpoint
from phalanx.errors import PhalanxError
from phalanx.cli import COMMANDS


def _environment_and_output(ctx, name):
    print(f"rank {ctx.rank} says hello", flush=True)
    return os.environ.get(name)


@pytest.mark.slow
def test_a_worker_has_the_parents_environment_and_output_of_now_not_the_servers(capfd, monkeypatch):
    run_workers(_environment_and_output, 2, "PHALANX_TEST_LATE")  # the server is running after this
    monkeypatch.setenv("PHALANX_TEST_LATE", "set after the fork server started")
    assert run_workers(_environment_and_output, 2, "PHALANX_TEST_LATE") == "set after the fork server started"
    out = capfd.readouterr().out  # fds 1 and 2 as pytest holds them now: the workers wrote there
    assert out.count("rank 0 says hello") == 2 and out.count("rank 1 says hello") == 2, out


def test_importing_the_cli_imports_no_torch():
    code = ("import sys; import phalanx, phalanx.cli, phalanx.launcher.forkserver, phalanx.launcher.env; "
            "print(sorted(m for m in ('torch', 'sklearn', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


@pytest.mark.parametrize("argv", [["--version"], ["--help"], []])
def test_the_version_and_the_list_of_commands_are_printed_without_importing_torch(argv):
    """0.1 s of CPU instead of 2.5 to 2.9 s: no command's flags are laid out (train's import torch) where none is
    named."""
    code = (f"import sys\nfrom phalanx.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n"
            f"    print('exit', e.code)\nprint(sorted(m for m in ('torch', 'phalanx.train') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-2:] == [f"exit {2 if not argv else 0}", "[]"], out


def _has(ctx, module):
    return module in sys.modules


@pytest.mark.slow
def test_a_process_that_built_a_hugging_face_model_starts_a_server_that_imported_transformers(tmp_path, monkeypatch):
    """A Hugging Face model's class imports transformers' modeling machinery in every worker that unpickles it (2.4 to
    3.4 s of CPU each, on every fit): the server imports it once, where the process starting it has imported it."""
    code = ("import sys\nimport transformers\nfrom phalanx.launcher import launch\nfrom test_startup import _has\n"
            "if __name__ == '__main__':\n"
            "    print(launch(_has, ['cpu', 'cpu'], ('transformers.modeling_utils',), timeout_s=120))\n")
    (tmp_path / "job.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr[-2000:]
    from phalanx.launcher.forkserver import MODELS, PRELOAD, TRACING, preload

    monkeypatch.delitem(sys.modules, TRACING, raising=False)  # (a test here may have traced a pipeline before)
    monkeypatch.setitem(sys.modules, "transformers", sys.modules.get("transformers"))
    assert preload() == PRELOAD + [MODELS]
    monkeypatch.delitem(sys.modules, "transformers")
    assert preload() == PRELOAD  # (a process that has not imported it: no server imports it for nothing)


def test_the_servers_import_of_a_model_library_leaves_any_error_to_the_workers(monkeypatch, tmp_path):
    """multiprocessing's server ends on any error but an ImportError in its preload: every later job would fail."""
    import importlib

    import phalanx.launcher.forkserver as forkserver

    (tmp_path / "broken_library.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(forkserver, "MODEL_LIBRARIES", {"broken_library": "broken_library"})
    monkeypatch.delitem(sys.modules, forkserver.MODELS, raising=False)
    importlib.import_module(forkserver.MODELS)  # (as the server imports it: nothing raised)
    assert "broken_library" not in sys.modules


#: what phalanx train's parent has no use for: the other commands' code, and what only they (or a flag not
#: given) need
NOT_FOR_TRAIN = ("phalanx.compare", "phalanx.estimate", "phalanx.topology.cli", "phalanx.topology.probe",
                 "phalanx.simulate.options", "phalanx.train.evaluate", "matplotlib", "transformers", "tensorboard",
                 "sklearn")


@pytest.mark.parametrize("argv, starts", [
    (["train", "--workers", "1"], False), (["train", "--model", "mlp", "--workers=1"], False),
    (["train", "--workers", "1", "--loader-workers", "2"], True),  # (its loader workers fork from the server)
    (["train"], True), (["train", "--workers", "2"], True), (["compare"], True), (["compare", "--simulate"], True),
    (["compare", "--simulate", "--step-time", "10ms", "--link-bandwidth", "1GB/s", "--link-latency", "5us"], False),
    (["estimate"], True),  # (its measuring processes: 15 s -> 10 s for the mlp on 1,2 workers, its server forked)
    (["topology"], False), (["train", "--help"], False)])
def test_the_worker_server_starts_early_only_for_a_run_that_will_start_workers(argv, starts, monkeypatch):
    """A run in this one process (``--workers 1``) starts no server: its import of torch (3.5 s of CPU here,
    torch._dynamo included) would be for nobody; the run's CPU went from 8.7 s to 5.3 s, 3 steps of the mlp."""
    import phalanx.cli as cli
    import phalanx.launcher.forkserver as forkserver

    started = []
    monkeypatch.setattr(forkserver, "start_early", lambda fork, **what_it_will_run: started.append(argv))
    monkeypatch.delenv("PHALANX_START_METHOD", raising=False)
    try:
        args = cli.build_parser(only=argv[0]).parse_args(argv)
    except SystemExit:  # (--help: printed and ended as the flags are read, before the server would start)
        assert not starts
    else:
        cli._start_worker_server(args, fresh=True)
    assert bool(started) == starts


def test_the_users_modules_are_imported_before_the_server_forks_so_that_every_worker_has_them(monkeypatch, tmp_path,
                                                                                              capsys):
    """A Hugging Face model's module imports transformers' modeling machinery: 2.4 to 3.4 s of CPU in each worker
    where the server forked before the command imported it. A module that cannot import is left to the planning."""
    import phalanx.cli as cli
    import phalanx.launcher.forkserver as forkserver
    import phalanx.task.import_paths as import_paths

    (tmp_path / "early_mod.py").write_text("import torch\n\nNet = torch.nn.Linear\n")
    (tmp_path / "early_raises.py").write_text("print('ran')\nraise RuntimeError('at import')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(import_paths, "_failed", {})
    monkeypatch.delenv("PHALANX_START_METHOD", raising=False)
    typed = ["train", "--model", "early_mod:Net", "--data", "early_raises:load", "--loss", "early_missing:mine",
             "--workers", "2"]
    args = cli.build_parser(only="train").parse_args(typed)
    assert cli._code_modules(args) == ["early_mod", "early_raises", "early_missing"]
    had = []
    monkeypatch.setattr(forkserver, "_fork_server", lambda imports, preload: had.append(set(sys.modules)) or True)
    cli._start_worker_server(args, fresh=True)
    assert "early_mod" in had[0] and "early_missing" not in had[0]  # (nothing raised here)
    capsys.readouterr()
    for spec, flag, said in [("early_raises:load", "--data", "importing module 'early_raises' raised RuntimeError: at "
                              "import"), ("early_missing:mine", "--loss", "cannot import module 'early_missing'")]:
        with pytest.raises(PhalanxError, match=f"{flag} {spec}: {said}"):  # where the run resolves it, as before
            import_paths.resolve(spec, flag, "")
    assert capsys.readouterr().out == ""  # (the module's top level ran once, before the fork)


@pytest.mark.parametrize("flags, builds", [([], False), (["--optimizer", "adam"], False),
                                           (["--optimizer", "mine:adamw"], True),
                                           (["--lr-scheduler", "mine:cosine"], True)])
def test_a_command_that_will_try_the_users_optimizer_imports_torch_dynamo_before_the_server_forks(flags, builds,
                                                                                                monkeypatch, tmp_path):
    """The parent tries a user's optimizer or scheduler factory on the model, and constructing any torch.optim
    optimizer imports torch._dynamo (1.4 s of CPU here): imported before the fork, it is imported once for both
    (the GPT example's run took 8.1 s of CPU, median of 6, and now 6.4 s)."""
    import phalanx.launcher.forkserver as forkserver

    shared, _ = _server_forked_by(["train", *flags], monkeypatch, tmp_path)
    assert ("torch._dynamo" in shared) == builds and set(forkserver.SHARED) <= set(shared)


@pytest.mark.parametrize("typed, traces, compiles", [
    (["train"], False, False), (["train", "--strategy", "pipeline"], True, False),
    (["train", "--compile"], False, True), (["compare", "--strategies", "sync,pipeline"], True, False),
    (["estimate", "--strategy", "pipeline"], False, False)])
def test_a_command_whose_workers_will_trace_or_compile_has_the_server_import_that_once_for_them(typed, traces, compiles,
                                                                                               monkeypatch, tmp_path):
    """A pipeline's workers may trace the model with torch.export (0.3 s of CPU a worker here) and --compile's
    compile with inductor (1.5 s): the server imports it for them all (estimate prices a pipeline by its blocks)."""
    import phalanx.launcher.forkserver as forkserver

    monkeypatch.delitem(sys.modules, forkserver.TRACING, raising=False)  # (this process may have traced already)
    _, preload = _server_forked_by(typed, monkeypatch, tmp_path)
    assert (forkserver.TRACING in preload, forkserver.COMPILING in preload) == (traces, compiles)
    assert set(forkserver.PRELOAD) <= set(preload)


def _server_forked_by(typed: list[str], monkeypatch, tmp_path) -> tuple[list[str], list[str]]:
    """What the command ``typed`` (on 2 workers) would import before its fork server forks, and what the server would
    import after (the fork itself stood in for)."""
    import phalanx.cli as cli
    import phalanx.launcher.forkserver as forkserver
    import phalanx.task.import_paths as import_paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(import_paths, "_failed", {})
    monkeypatch.delenv("PHALANX_START_METHOD", raising=False)
    forks = []
    monkeypatch.setattr(forkserver, "_fork_server", lambda shared, preload: forks.append((shared, preload)) or True)
    cli._start_worker_server(cli.build_parser(only=typed[0]).parse_args([*typed, "--workers", "2"]), fresh=True)
    return forks[0]


def test_a_command_whose_users_module_opened_a_cuda_context_starts_the_server_as_a_new_interpreter(monkeypatch):
    """A worker forked from a process holding a CUDA context cannot use CUDA (the user's module, imported before the
    server forks, may have made one: a tensor put on the GPU at its top level)."""
    import multiprocessing.forkserver as mp_forkserver

    import phalanx.launcher.forkserver as forkserver

    how = []
    monkeypatch.setattr(forkserver, "_cuda_is_initialized", lambda: True)
    monkeypatch.setattr(forkserver, "_fork_server", lambda imports, preload: how.append("forked") or True)
    monkeypatch.setattr(forkserver, "start_resource_tracker", lambda: None)
    monkeypatch.setattr(mp_forkserver, "ensure_running", lambda: how.append("new interpreter"))
    forkserver.start_early(fork=True)
    assert how == ["new interpreter"]


def test_phalanx_train_plans_its_run_without_the_other_commands_code(tmp_path):
    code = ("import sys\n"
            "from phalanx.cli import build_parser, chosen_command, config_from_args\n"
            "from phalanx.train import Trainer\n"
            "argv = ['train', '--steps', '1', '--checkpoint-dir', 'ck']\n"
            "Trainer(config_from_args(build_parser(only=chosen_command(argv)).parse_args(argv))).plan()\n"
            f"print(sorted(m for m in sys.modules if m.startswith({NOT_FOR_TRAIN!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_help_lists_every_command_with_its_line(capsys):
    code, out = run_main(["--help"], capsys)
    assert code == 0
    text = " ".join(out.out.split())  # argparse wraps the lines
    for name, command in COMMANDS.items():
        assert f"{name} {command.help}" in text, (name, out.out)


def _collector(ctx):
    return gc.isenabled(), gc.get_freeze_count()


def test_a_forked_worker_collects_garbage_and_leaves_what_the_server_imported_frozen():
    enabled, frozen = run_workers(_collector, 2)
    assert enabled and frozen > 100_000  # torch's objects, imported by the server with the collector off


@pytest.mark.slow
def test_forked_and_spawned_workers_train_to_the_same_parameters_and_the_start_up_is_profiled(tmp_path):
    """The forked run reads its Dataset with a loader worker per rank, the spawned one in memory (the same batches:
    tests/test_loader_workers.py)."""
    shutil.copy(REPO / "tests" / "fixtures" / "points.py", tmp_path)  # a Dataset made item by item
    flags = ["train", "--steps", "6", "--model", "mlp", "--data", "points:load", "--log-every", "3",
             "--profile-startup"]
    # (each import's time on stderr, torch._C's once per interpreter that imports torch: the command's fork server
    # is a fork of the command, and each rank's loader workers' server a fork of the rank, so torch is imported once
    # for all, where each new interpreter imported it again)
    forked = subprocess.run(phalanx_cmd() + flags + ["--loader-workers", "1", "--checkpoint-dir", "forked"],
                            cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPROFILEIMPORTTIME="1"))
    assert len(re.findall(r"^import time: .*\|\s+torch\._C$", forked.stderr, re.M)) == 1, forked.stderr[-3000:]
    spawned = subprocess.run([sys.executable, "-m", "phalanx", *flags, "--checkpoint-dir", "spawned"], cwd=tmp_path,
                             capture_output=True, text=True, env=dict(os.environ, PHALANX_START_METHOD="spawn"))
    assert forked.returncode == 0 and spawned.returncode == 0, forked.stderr + spawned.stderr
    a, b = load_checkpoint(tmp_path / "forked")["model"], load_checkpoint(tmp_path / "spawned")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    line = next(x for x in forked.stdout.splitlines() if x.startswith("start-up "))
    assert "to the first step: imports and the parent's checks" in line and "first training step +" in line, line
    summary = [json.loads(x) for x in open(tmp_path / "forked" / "metrics.jsonl")][-1]
    phases = summary["startup_seconds"]
    assert list(phases) == ["plan", "joined", "data", "model", "calibration", "strategy", "first_step"]
    assert all(b >= a for a, b in zip(phases.values(), list(phases.values())[1:])), phases  # in order, in time


def test_an_unknown_start_method_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_START_METHOD", "fork")
    out = run_in_process("train", "--steps", "1", "--model", "mlp", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: PHALANX_START_METHOD=fork is not a way to start workers: use one of "
                                  "forkserver, spawn, or unset it"), out.stderr
