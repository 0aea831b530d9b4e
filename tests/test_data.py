import numpy as np
import pytest
import torch

from phalanx.data import ArrayDataset, ShardedBatches, eval_batches, load_cifar10, load_digits, load_synthetic
from phalanx.data.datasets import cifar_augment_params, cifar_eval_transform, cifar_train_transform, standardize
from phalanx.data.loader import Prefetcher, prefetch_depth
from phalanx.errors import PhalanxError


def test_digits_is_the_real_set_with_a_fixed_split():
    a, b = load_digits(), load_digits()
    assert len(a.train) + len(a.test) == 1797
    assert len(a.test) == 360
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10
    assert torch.equal(a.train.y, b.train.y) and torch.equal(a.test.x, b.test.x)
    assert set(a.test.y.tolist()) == set(range(10))


def _indices(data, batch, rank, world, steps, start=0):
    loader = ShardedBatches(data, batch, rank, world, seed=3)
    it = loader(start)
    return [next(it)[1] for _ in range(steps)]


def test_every_example_once_per_epoch_across_workers():
    n = 50
    data = ArrayDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))
    per_epoch = n // (4 * 3)  # 4 per worker x 3 workers
    seen = torch.cat([y for r in range(3) for y in _indices(data, 4, r, 3, per_epoch)])
    assert len(seen) == len(set(seen.tolist())) == per_epoch * 12  # no repeats within the epoch
    # the next epoch is a different shuffle
    nxt = torch.cat([y for r in range(3) for y in _indices(data, 4, r, 3, per_epoch, start=per_epoch)])
    assert not torch.equal(seen, nxt)


def test_workers_together_see_what_one_process_sees():
    data = ArrayDataset(torch.randn(100, 2), torch.arange(100))
    one = _indices(data, 10, 0, 1, 7)
    two = [_indices(data, 5, r, 2, 7) for r in range(2)]
    for step in range(7):
        assert torch.equal(one[step], torch.cat([two[0][step], two[1][step]]))


def test_starting_at_a_step_continues_the_same_stream():
    data = ArrayDataset(torch.randn(64, 2), torch.arange(64))
    full = _indices(data, 8, 1, 2, 12)
    resumed = _indices(data, 8, 1, 2, 5, start=7)
    for a, b in zip(full[7:], resumed):
        assert torch.equal(a, b)


def test_global_batch_larger_than_data_is_an_error():
    data = ArrayDataset(torch.randn(10, 2), torch.arange(10))
    with pytest.raises(PhalanxError, match=r"global batch 12 \(6 per worker x 2 workers\) is larger than the 10"):
        ShardedBatches(data, 6, 0, 2)


def test_eval_shares_cover_the_set_once():
    data = ArrayDataset(torch.randn(11, 2), torch.arange(11))
    ys = torch.cat([y for r in range(3) for _, y in eval_batches(data, 2, r, 3)])
    assert sorted(ys.tolist()) == list(range(11))


def _write_cifar(root, n_per_file=4):
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name in names:
        records = np.zeros((n_per_file, 3073), np.uint8)
        records[:, 0] = rng.integers(0, 10, n_per_file)
        records[:, 1:] = rng.integers(0, 256, (n_per_file, 3072))
        records.tofile(root / name)
    return records


def test_cifar10_binary_files_are_read(tmp_path):
    last = _write_cifar(tmp_path)
    bundle = load_cifar10(tmp_path)
    assert len(bundle.train) == 20 and len(bundle.test) == 4
    assert torch.equal(bundle.test.y, torch.from_numpy(last[:, 0].astype(np.int64)))
    # pixels are channel-major 32x32 planes, as the binary format stores them
    assert torch.equal(bundle.test.x[1, 2, 0, :3], torch.from_numpy(last[1, 1 + 2048:1 + 2051]))


def test_cifar10_missing_file_names_the_expected_files(tmp_path):
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_3.bin").unlink()
    with pytest.raises(PhalanxError, match=r"missing in .*: data_batch_3.bin \(expected data_batch_1.bin"):
        load_cifar10(tmp_path)


def test_cifar10_truncated_file(tmp_path):
    _write_cifar(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(PhalanxError, match="not a CIFAR-10 binary file"):
        load_cifar10(tmp_path)


def test_cifar_augmentation_crops_flips_and_standardizes():
    x = torch.arange(2 * 3 * 32 * 32, dtype=torch.float32).view(2, 3, 32, 32) % 251
    params = torch.tensor([[0, 0, 0], [8, 5, 1]])
    out = cifar_train_transform(x.to(torch.uint8), params)
    assert out.shape == (2, 3, 24, 24)
    expected0 = standardize(x[:1, :, 0:24, 0:24])
    expected1 = standardize(x[1:, :, 8:32, 5:29].flip(-1))
    assert torch.allclose(out[0], expected0[0], atol=1e-5)
    assert torch.allclose(out[1], expected1[0], atol=1e-5)
    flat = out.flatten(1)
    assert torch.allclose(flat.mean(1), torch.zeros(2), atol=1e-5)
    assert torch.allclose(flat.std(1, unbiased=False), torch.ones(2), atol=1e-4)
    centre = cifar_eval_transform(x.to(torch.uint8), None)
    assert torch.allclose(centre[0], standardize(x[:1, :, 4:28, 4:28])[0], atol=1e-5)
    p = cifar_augment_params(1000, torch.Generator().manual_seed(0))
    assert p[:, :2].min() == 0 and p[:, :2].max() == 8 and set(p[:, 2].tolist()) == {0, 1}


def test_synthetic_is_learnable_shape():
    b = load_synthetic((3, 8, 8), size=100)
    assert b.train.x.shape[1:] == (3, 8, 8) and len(b.train) + len(b.test) == 100


def test_prefetcher_keeps_order_and_bounds_queue():
    produced = []

    def batches():
        for i in range(10):
            produced.append(i)
            yield torch.tensor([i]), torch.tensor([i])

    pf = Prefetcher(batches(), torch.device("cpu"), depth=2)
    first = next(pf)
    assert first[0].item() == 0
    import time

    time.sleep(0.2)
    assert len(produced) <= 4  # one consumed, at most depth queued, one in hand
    assert [x.item() for x, _ in pf] == list(range(1, 10))
    pf.close()


def test_depth_zero_reads_each_batch_when_asked_and_is_the_cpu_default():
    produced = []

    def batches():
        for i in range(5):
            produced.append(i)
            yield torch.tensor([i]), torch.tensor([i])
        produced.append("closed")  # not reached: close() ends the source where it stands

    pf = Prefetcher(batches(), torch.device("cpu"), depth=0)
    assert pf.thread is None and produced == []
    assert [next(pf)[0].item() for _ in range(3)] == [0, 1, 2] and produced == [0, 1, 2]
    pf.close()
    assert produced == [0, 1, 2] and pf.inline.gi_frame is None  # the generator was closed
    assert (prefetch_depth(None, torch.device("cpu")), prefetch_depth(None, torch.device("cuda"))) == (0, 2)
    assert prefetch_depth(3, torch.device("cpu")) == 3


def test_prefetcher_surfaces_loader_errors():
    def batches():
        yield torch.zeros(1), torch.zeros(1)
        raise ValueError("bad batch")

    pf = Prefetcher(batches(), torch.device("cpu"))
    next(pf)
    with pytest.raises(ValueError, match="bad batch"):
        next(pf)
