"""Real digits (scikit-learn's 8 x 8 set): a conv net with BatchNorm against PyTorch, exact mode.

The run trains `conv(4, 3, pad=1) batchnorm relu maxpool(2) flatten dense` on 3 thread ranks
from the parameters `--steps 0 --save` writes; PyTorch trains the same nn.Sequential, loaded from
that file, serially on the same global batches in the same order (README, "What one step does").
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest

from syncsgd import TrainConfig, train
from syncsgd.cli import main as syncsgd_main
from syncsgd.training.result import sha256
from syncsgd.training.run import prepare

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None,
    reason="--data digits needs the data extra (pip install -e '.[data]': scikit-learn)",
)

SPEC = "conv(4, 3, pad=1) batchnorm relu maxpool(2) flatten dense"
CONFIG = TrainConfig(data="digits", model=SPEC, batch_size=64, steps=12, lr=0.1, momentum=0.9,
                     weight_decay=1e-3, holdout=0.5, batchnorm="sync", seed=3)  # fmt: skip


def global_batch(step: int, n_samples: int, batch_size: int, seed: int) -> np.ndarray:
    """Rows of global batch `step`, as the README states the order (shuffled epochs)."""
    per_epoch = n_samples // batch_size
    order = np.random.default_rng([seed, step // per_epoch]).permutation(n_samples)
    j = step % per_epoch
    return order[j * batch_size : (j + 1) * batch_size]


def relative_difference(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> float:
    """max |Δθ| / max(1, max |θ|) over every array the two share (and they must share all)."""
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
    delta = max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in ours)
    scale = max(float(np.max(np.abs(theirs[k]))) for k in theirs)
    return delta / max(1.0, scale)


def test_sync_conv_batchnorm_on_digits_equals_pytorch(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    start = tmp_path / "start.npz"
    args = ["train", "--data", "digits", "--model", SPEC, "--seed", str(CONFIG.seed),
            "--holdout", str(CONFIG.holdout), "--steps", "0", "--save", str(start)]  # fmt: skip
    assert syncsgd_main(args) == 0
    capsys.readouterr()
    config = replace(CONFIG, init=str(start))
    run = prepare(config)  # the X and y (training rows, after the holdout) the run uses
    assert len(run.X) == 1797 - round(1797 * CONFIG.holdout)

    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 10),
    ).double()  # fmt: skip
    loaded = {k: torch.from_numpy(v) for k, v in np.load(start).items()}
    missing, unexpected = net.load_state_dict(loaded, strict=False)
    assert unexpected == [] and all(k.endswith("num_batches_tracked") for k in missing)
    sgd = torch.optim.SGD(net.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)  # fmt: skip
    X = torch.from_numpy(run.X.reshape(len(run.X), 1, 8, 8))
    y = torch.from_numpy(run.y).long()
    net.train()
    for step in range(config.steps):
        rows = torch.from_numpy(global_batch(step, len(run.X), config.batch_size, config.seed))
        loss = torch.nn.functional.cross_entropy(net(X[rows]), y[rows])  # the global batch's mean
        sgd.zero_grad()
        loss.backward()
        sgd.step()

    ours = train(config, ranks=3).arrays()
    theirs = {k: v.detach().numpy() for k, v in net.state_dict().items()
              if not k.endswith("num_batches_tracked")}  # fmt: skip
    assert {"1.running_mean", "1.running_var"} <= set(ours)
    assert relative_difference(ours, theirs) <= 1e-9
    # and the training moved the parameters well beyond that tolerance
    assert relative_difference(dict(np.load(start)), theirs) > 1e-3


def test_exact_mode_on_digits_one_sha256_for_every_p():
    config = replace(CONFIG, steps=3, exact=True, holdout=0.8)
    digests = set()
    for ranks in (1, 2, 3, 5, 8):
        result = train(config, ranks=ranks)
        digests.add(sha256(np.concatenate([result.params, result.running])))
    assert len(digests) == 1, digests
