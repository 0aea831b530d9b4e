"""The user's problem (issue 19): model, data, loss and optimizer by import path through the real ``phalanx``
command, any map-style Dataset through the API, a validation split, adamw, user-model checkpoints."""

import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from helpers import run_cli, run_in_process, run_main
from phalanx import TrainConfig, Trainer
from phalanx.errors import PhalanxError

#: A user's own file, as docs/your-model.md shows it: a model, scikit-learn data (float64), a loss, an optimizer.
MODULE = '''
import numpy as np
import torch
from torch import nn
from sklearn.datasets import load_digits

HIDDEN = 32


class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc1 = nn.Linear(int(np.prod(input_shape)), HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, num_classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def load():
    d = load_digits()
    x = d.data / 16.0  # float64, as scikit-learn gives it
    return (x[:1500], d.target[:1500]), (x[1500:], d.target[1500:])


def train_only():
    d = load_digits()
    return (torch.utils.data.TensorDataset(torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target)),
            None)


def loss(out, y):
    return nn.functional.cross_entropy(out, y, label_smoothing=0.05)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


def stream():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ()
    return Stream(), None


def not_a_model():
    return torch.zeros(3)


def one_set():
    return load()[0]


def not_an_optimizer(params):
    return list(params)
'''

SMALL = ["--steps", "10", "--log-every", "5", "--batch-size", "16", "--workers", "2", "--devices", "cpu"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    (root / "mymod.py").write_text(MODULE)
    return root


@pytest.mark.slow
def test_import_paths_train_a_float64_scikit_learn_set_and_a_changed_model_is_refused_on_resume(project):
    out = run_cli("train", "--model", "mymod:Net", "--data", "mymod:load", "--loss", "mymod:loss",
                  "--optimizer", "mymod:adamw", *SMALL, "--checkpoint-dir", "sync", cwd=project)
    assert out.returncode == 0, out.stderr
    assert "mymod:Net on mymod:load" in out.stdout
    assert out.stdout.count("inputs float64 cast to float32") == 1
    assert "recipe: mymod:adamw, its own lr, 10 steps" in out.stdout
    assert "test accuracy" in out.stdout
    state = torch.load(project / "sync" / "step-00000010.pt", weights_only=False)
    meta = state["meta"]
    assert (meta["model"], meta["model_class"], meta["data"]) == ("mymod:Net", "mymod.Net", "mymod:load")
    assert meta["parameter_shapes"]["fc1.weight"] == [32, 64]
    assert "exp_avg" in state["optimizer"]["state"][0]  # the factory's AdamW, its state checkpointed
    # The same module with a narrower layer: one line naming the first parameter that differs, nothing written.
    (project / "narrow").mkdir()
    (project / "narrow" / "mymod.py").write_text(MODULE.replace("HIDDEN = 32", "HIDDEN = 16"))
    before = sorted(p.name for p in (project / "sync").iterdir())
    out = run_in_process("train", "--model", "mymod:Net", "--data", "mymod:load", "--steps", "20", "--devices", "cpu",
                         "--resume", str(project / "sync" / "step-00000010.pt"), "--checkpoint-dir",
                         str(project / "sync"), cwd=project / "narrow")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: checkpoint {project}/sync/step-00000010.pt holds another model (fc1.weight is (32, 64) there and "
        "(16, 64) here); resume with the model and data it was trained with (--model mymod:Net --data mymod:load)"]
    assert sorted(p.name for p in (project / "sync").iterdir()) == before


@pytest.mark.slow
def test_the_parameter_server_uses_the_factory_and_a_validation_split_says_validation(project):
    out = run_in_process("train", "--model", "mymod:Net", "--data", "mymod:train_only", "--optimizer", "mymod:adamw",
                         "--strategy", "ps", "--validation-split", "0.2", "--eval-every", "5", *SMALL,
                         "--checkpoint-dir", "ps", cwd=project)
    assert out.returncode == 0, out.stderr
    assert "step 5, validation accuracy " in out.stdout and "validation accuracy " in out.stdout
    assert "test accuracy" not in out.stdout
    state = torch.load(project / "ps" / "step-00000010.pt", weights_only=False)
    assert state["meta"]["settings"]["optimizer"] == "mymod:adamw"
    assert "exp_avg" in state["optimizer"]["state"][0]  # the server owns the user's optimizer


BAD = [
    (["--model", "mymod:Nope"], "--model mymod:Nope: module 'mymod' has no attribute 'Nope'"),
    (["--model", "nomod:Net"], "--model nomod:Net: cannot import module 'nomod' (ModuleNotFoundError"),
    (["--model", "mymod:not_a_model"], "--model mymod:not_a_model: returned Tensor; expected a torch.nn.Module"),
    (["--data", "mymod:one_set"], "--data mymod:one_set: its train set must be a pair (inputs, targets)"),
    (["--data", "mymod:stream"], "--data mymod:stream: its train set is an IterableDataset (Stream): phalanx "
                                 "shards data by index"),
    (["--loss", "mymod:HIDDEN"], "--loss mymod:HIDDEN: 'HIDDEN' is a int, not callable"),
    (["--optimizer", "mymod:not_an_optimizer"], "the optimizer factory mymod:not_an_optimizer returned list; "
                                                "expected a torch.optim.Optimizer"),
]


@pytest.fixture
def in_project(project, monkeypatch):
    """The project as the current folder of this process, for the command's main() run here (what resolving its
    import paths leaves behind is undone after each test: conftest.py)."""
    monkeypatch.chdir(project)
    return project


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", BAD, ids=[f[1] for f, _ in BAD])
def test_a_bad_import_path_is_one_line_and_nothing_starts(in_project, flags, message, capsys):
    # (in this process: the refusal comes before any worker; the installed command's refusal of a
    # changed model is checked above)
    code, out = run_main(["train", *flags, "--steps", "2", "--devices", "cpu", "--checkpoint-dir", "never"], capsys)
    assert code == 2, out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.err
    assert not (in_project / "never").exists()


@pytest.mark.parametrize("values, message", [
    (dict(optimizer="mymod:adamw", lr=0.1), "--lr applies to the built-in optimizers (sgd, adam, adamw); "
                                            "--optimizer mymod:adamw builds its own"),
    (dict(optimizer="adamw", momentum=0.9), "--momentum applies to --optimizer sgd, and this run has --optimizer "
                                            "adamw"),
    (dict(validation_split=1.5), r"--validation-split must be a fraction in \(0, 1\)"),
])
def test_flags_that_do_not_apply_to_the_optimizer_are_refused(values, message):
    with pytest.raises(PhalanxError, match=message if "\\" in message else re.escape(message)):
        TrainConfig(**values)


def test_the_api_refuses_an_iterable_dataset_and_a_bare_iterable_in_one_line():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ()

    with pytest.raises(PhalanxError, match=r"train_data is an IterableDataset \(Stream\): phalanx shards data by "
                                           "index, so that every epoch's order is deterministic"):
        Trainer(TrainConfig(devices="cpu"), model=nn.Linear(4, 2), train_data=Stream())


def _train(tmp_path, name, data):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    cfg = TrainConfig(workers=2, devices="cpu", steps=4, batch_size=8, optimizer="adamw", weight_decay=0.1,
                      lr=0.01, progress="none", checkpoint_dir=str(tmp_path / name))
    summary = Trainer(cfg, model=model, train_data=data).fit()
    return torch.load(summary["checkpoint"], weights_only=False)


@pytest.mark.slow
def test_a_tensor_dataset_trains_as_the_same_tensors_do_under_adamw(tmp_path):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(120, 8, generator=gen, dtype=torch.float64)  # float64: cast for the float32 model
    y = torch.randint(0, 3, (120,), generator=gen)
    by_dataset = _train(tmp_path, "dataset", TensorDataset(x, y))
    by_arrays = _train(tmp_path, "arrays", (x.numpy(), y.numpy()))
    for name, value in by_arrays["model"].items():
        torch.testing.assert_close(by_dataset["model"][name], value, rtol=0, atol=0)
    assert by_dataset["meta"]["settings"]["optimizer"] == "adamw"
    assert by_dataset["optimizer"]["param_groups"][0]["weight_decay"] == 0.1
    assert by_dataset["meta"]["data"] == "your data"


class Pairs(torch.utils.data.Dataset):
    """A map-style dataset of numpy (input, target) items, as a user's own class would be."""

    def __init__(self, n):
        self.x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], np.int64(i % 2)


def test_a_map_style_dataset_of_numpy_items_is_read_once_into_tensors_with_a_seeded_validation_split():
    from phalanx.data.user import user_bundle

    first, again = user_bundle(Pairs(50), None, 0.2, seed=3), user_bundle(Pairs(50), None, 0.2, seed=3)
    assert (len(first.train), len(first.test), first.held_out) == (40, 10, "validation")
    assert torch.equal(first.test.x, again.test.x)  # the same examples held out on every run with this seed
    assert torch.equal(torch.sort(torch.cat([first.train.x[:, 0], first.test.x[:, 0]])).values,
                       torch.arange(0, 200, 4, dtype=torch.float32))
