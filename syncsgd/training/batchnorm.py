"""BatchNorm in training: the local gradient that normalises layer by layer, and evaluation.

--batchnorm sync allreduces the per-feature sums between layers, so the statistics are those of
the global batch and training equals serial large-batch SGD with BatchNorm; --batchnorm local
normalises each rank's shard alone (Tarantella's and DDP's default), so the result depends on P.
Per normalised layer and step: two allreduces forward (the sum, then the centred squares: the
two-pass variance) and one backward (the two sums of the gradient); exact mode agrees on a bound
(Allreduce MAX) before each. docs/batchnorm.md gives the derivation, the costs and the caution.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from syncsgd.collectives import allreduce as collective_allreduce
from syncsgd.comm.watchdog import bcast_peer, watching
from syncsgd.comm.world import constants
from syncsgd.nn.mlp import MLP

if TYPE_CHECKING:
    from syncsgd.training.run import Run


class LayerStats:
    """One normalised layer's batch statistics of the current step (float64, per feature)."""

    def __init__(self, width: int) -> None:
        self.forward = np.zeros(width + 1)  # the sum, then the count; reused for the squares
        self.backward = np.zeros(2 * width)  # sum of g, then sum of g zhat
        self.peaks = np.zeros(2 * width)  # exact mode: the bounds the ranks agree on
        self.mean = np.zeros(width)
        self.inv_std = np.zeros(width)
        self.count = 0.0  # N: the samples the statistics are over


class BatchNormLocalGradient:
    """--batchnorm local|sync: the passes layer by layer, the normalising sums allreduced (sync)."""

    scale = 1.0  # no loss scaling with BatchNorm

    def __init__(self, config: Any, model: MLP, max_batch: int, buffer: Any,
                 trace: Any = None) -> None:  # fmt: skip
        from syncsgd.nn import batchnorm, kernels  # imports Numba: only when training

        self.nb, self.kernels = batchnorm, kernels
        self.model, self.exact, self.sync = model, config.exact, config.batchnorm == "sync"
        self.eps, self.momentum = config.bn_eps, config.bn_momentum
        self.global_batch, self.max_batch = config.batch_size, max_batch
        self.work = batchnorm.BatchNormWork(model, max_batch)
        self.activation = kernels.ACTIVATION_CODES[model.activation]
        self.stats = [LayerStats(fan_out) for _, fan_out in model.layer_shapes()]
        self.running = model.init_running()  # rank 0's are the run's (local); alike (sync)
        self.bounds = np.zeros(self.work.bound_count)
        self.loss_slot = buffer.register("loss sum").start
        self.n_params = model.n_params
        self.allreduce_ = functools.partial(collective_allreduce, algorithm=config.algorithm,
                                            check=False, trace=trace)  # fmt: skip
        self.comm_seconds = [0.0, 0.0]  # in BatchNorm's allreduces: the first call, the others
        self.calls = 0
        self.m = 0  # the samples of the pass under way
        # How --overlap cuts this into pieces (training/overlap.py); exact mode's extraction is
        # the work's, named as ExactLocalGradient names its own.
        self.pieces, self.kernel = ("exact" if self.exact else "batchnorm"), self.work

    def __call__(self, comm: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                 sums: np.ndarray) -> None:  # fmt: skip
        """Fill `sums` with this shard's gradient sum and loss sum."""
        if self.exact:
            if self.agree_(comm, params, X, y, sums):
                self.work.accumulate(self.bounds, self.global_batch, sums[: self.loss_slot + 1])
            return
        self.forward_loss_(comm, params, X, y, sums)
        self.backward_layers_(comm, params, sums, self.model.n_layers - 1, 0)

    # --overlap calls the pieces below: float mode `forward_loss_`, then `backward_layers_` a few
    # layers at a time; exact mode `agree_`, then `kernel`'s extraction a few layers at a time.

    def forward_loss_(self, comm: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                      sums: np.ndarray) -> None:  # fmt: skip
        """The forward pass, the loss and the logits' delta; float mode: the loss sum too."""
        X, y = self.kernels.check_batch(self.model, self.max_batch, X, y)
        self.m = X.shape[0]
        self.calls += 1
        logits = self.forward_(comm, self.model.views(params), self.work.begin(X), self.m)
        loss_sum = self.loss_delta_(logits, y, self.m)
        if not self.exact:
            sums[self.loss_slot] = loss_sum

    def backward_layers_(self, comm: Any, params: np.ndarray, sums: np.ndarray, top: int,
                         bottom: int) -> None:  # fmt: skip
        """The backward pass of layers top down to bottom; after layer l, its W, b, gamma and
        beta sums are complete (float mode; exact mode: gamma and beta)."""
        views, grads = self.model.views(params), self.model.views(sums[: self.n_params])
        for layer in range(top, bottom - 1, -1):
            self.layer_backward_(comm, views, grads, layer, self.m)

    def agree_(self, comm: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray,
               sums: np.ndarray) -> bool:  # fmt: skip
        """Exact mode: both passes and the bounds every rank agrees on; False (sums NaN) if those
        are not finite."""
        self.forward_loss_(comm, params, X, y, sums)
        self.backward_layers_(comm, params, sums, self.model.n_layers - 1, 0)
        self.work.end(self.m, self.bounds)
        mpi = constants(comm)
        with watching("exact mode's allreduce of the bounds"):
            comm.Allreduce(mpi.IN_PLACE, self.bounds, op=mpi.MAX)
        if not np.isfinite(self.bounds).all():  # the same on every rank: all skip or stop alike
            sums[:] = np.nan
            return False
        return True

    # -- forward -------------------------------------------------------------------------------

    def forward_(self, comm: Any, views: dict, inputs: np.ndarray, m: int) -> np.ndarray:
        """Every layer on the shard; the hidden ones normalised; returns the logits."""
        last = self.model.n_layers - 1
        for layer in range(self.model.n_layers):
            z = self.work.rows("h", layer, m)
            self.nb.dense_(self.work.layer_input(layer, m), views[f"W{layer}"],
                           views[f"b{layer}"], z, self.exact)  # fmt: skip
            if layer < last:
                self.normalise_(comm, views, layer, z, m)
        return self.work.rows("h", last, m)

    def normalise_(self, comm: Any, views: dict, layer: int, z: np.ndarray, m: int) -> None:
        """The batch statistics of z (allreduced when sync), zhat, then h = act(BN(z))."""
        stats, nb = self.stats[layer], self.nb
        n = z.shape[1]
        self.feature_sums_(comm, z, z, stats.mean, nb.VALUE, stats.forward[:n], stats.peaks[:n])
        stats.forward[n] = m  # the count travels with the sum: N is the group's, whatever P
        self.sum_(comm, stats.forward)
        stats.count = float(stats.forward[n])
        with np.errstate(invalid="ignore", divide="ignore"):  # an empty group: no sample uses it
            stats.mean[:] = stats.forward[:n] / stats.count
            self.feature_sums_(comm, z, z, stats.mean, nb.CENTRED_SQUARE, stats.forward[:n],
                               stats.peaks[:n])  # fmt: skip
            stats.forward[n] = 0.0
            self.sum_(comm, stats.forward)
            variance = stats.forward[:n] / stats.count  # biased: what the normalisation uses
            stats.inv_std[:] = 1.0 / np.sqrt(variance + self.eps)
        nb.normalise_activate_(z, stats.mean, stats.inv_std, views[f"gamma{layer}"],
                               views[f"beta{layer}"], self.work.rows("zhat", layer, m),
                               self.activation)  # fmt: skip
        self.update_running_(layer, stats, variance)

    def update_running_(self, layer: int, stats: LayerStats, variance: np.ndarray) -> None:
        """PyTorch's update: running = (1 - m) running + m batch, the variance unbiased."""
        # A group of one sample has no unbiased variance: its running variance stays (PyTorch
        # refuses such a batch in training); an empty group changes nothing.
        views = self.model.running_views(self.running)
        momentum, count = self.momentum, stats.count
        if count < 1:
            return
        mean, var = views[f"running_mean{layer}"], views[f"running_var{layer}"]
        mean[:] = (1 - momentum) * mean + momentum * stats.mean
        if count >= 2:
            var[:] = (1 - momentum) * var + momentum * (variance * (count / (count - 1)))

    # -- loss and backward ---------------------------------------------------------------------

    def loss_delta_(self, logits: np.ndarray, y: np.ndarray, m: int) -> float:
        """The loss sum (float mode) or per-sample losses (exact); the logits' delta."""
        delta = self.work.rows("delta", self.model.n_layers - 1, m)
        if self.exact:
            from syncsgd.nn import exact

            per_sample = (exact.xent_sample_losses_ if self.model.loss == "xent"
                          else exact.mse_sample_losses_)  # fmt: skip
            per_sample(logits, y, delta, self.work.losses(m))
            return 0.0
        kernel = (self.kernels.xent_loss_delta_ if self.model.loss == "xent"
                  else self.kernels.mse_loss_delta_)  # fmt: skip
        loss_sum, _ = kernel(logits, y, delta)
        return float(loss_sum)

    def layer_backward_(self, comm: Any, views: dict, grads: dict, layer: int, m: int) -> None:
        """Layer's W and b sums (float mode), then the delta below it through BatchNorm."""
        # The layer below's gamma and beta sums are taken here too: with the W and b sums of that
        # layer's own step, its gradient is complete.
        delta = self.work.rows("delta", layer, m)
        if not self.exact:
            self.nb.dense_backward_(self.work.layer_input(layer, m), delta,
                                    grads[f"W{layer}"], grads[f"b{layer}"])  # fmt: skip
        if layer == 0:
            return
        below = self.work.rows("delta", layer - 1, m)
        self.nb.propagate_(delta, views[f"W{layer}"], self.work.transposed(),
                           self.work.rows("h", layer - 1, m), below, self.activation,
                           self.exact)  # fmt: skip
        self.normalise_backward_(comm, views, grads, layer - 1, below, m)

    def normalise_backward_(self, comm: Any, views: dict, grads: dict, layer: int,
                            g: np.ndarray, m: int) -> None:  # fmt: skip
        """d gamma, d beta (this shard's sums, for the gradient allreduce); g becomes dz."""
        stats, nb = self.stats[layer], self.nb
        n = g.shape[1]
        zhat = self.work.rows("zhat", layer, m)
        self.feature_sums_(comm, g, zhat, stats.mean, nb.VALUE, stats.backward, stats.peaks)
        grads[f"beta{layer}"][:] = stats.backward[:n]  # summed with the gradient, later
        grads[f"gamma{layer}"][:] = stats.backward[n:]
        self.sum_(comm, stats.backward)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = stats.backward / stats.count
        scale = views[f"gamma{layer}"] * stats.inv_std
        nb.normalise_backward_(g, zhat, scale, means[:n], means[n:])

    # -- the sums ------------------------------------------------------------------------------

    def feature_sums_(self, comm: Any, a: np.ndarray, b: np.ndarray, c: np.ndarray, kind: int,
                      out: np.ndarray, peaks: np.ndarray) -> None:  # fmt: skip
        """This shard's per-feature sums of the term; with out twice as long, then of a b."""
        # Float mode: in sample order. Exact mode: at the fixed point of the peaks every rank
        # agreed on (one MAX-allreduce for both sums), so that the allreduced sums are exact.
        nb, n = self.nb, a.shape[1]
        kinds = [kind] if out.size == n else [kind, nb.PRODUCT]
        if not self.exact:
            for half, chosen in enumerate(kinds):
                nb.column_sums_(a, b, c, chosen, out[half * n : (half + 1) * n])
            return
        for half, chosen in enumerate(kinds):
            nb.column_peaks_(a, b, c, chosen, peaks[half * n : (half + 1) * n])
        self.max_(comm, peaks)
        magics = nb.magics(peaks, self.global_batch)
        for half, chosen in enumerate(kinds):
            part = slice(half * n, (half + 1) * n)
            nb.extract_column_sums_(a, b, c, chosen, magics[part], out[part])

    def sum_(self, comm: Any, values: np.ndarray) -> None:
        """Sync: sum over the ranks (the hand-written allreduce); local: the shard's alone."""
        if self.sync:
            started = time.perf_counter()
            self.allreduce_(values, comm)
            self.comm_seconds[self.calls > 1] += time.perf_counter() - started

    def max_(self, comm: Any, values: np.ndarray) -> None:
        """Sync: the largest over the ranks; local: the shard's own."""
        if self.sync:
            mpi, started = constants(comm), time.perf_counter()
            with watching("batch norm's allreduce of the bounds"):
                comm.Allreduce(mpi.IN_PLACE, values, op=mpi.MAX)
            self.comm_seconds[self.calls > 1] += time.perf_counter() - started


# -- the run's running statistics ---------------------------------------------------------------


def start_running(comm: Any, run: Run, stepper: Any) -> np.ndarray | None:
    """The running statistics the run starts from, rank 0's on every rank; None without BN."""
    running = running_of(stepper)
    if running is None:
        return None
    if comm.Get_rank() == 0:
        running[:] = first_running(run)
    with watching("the broadcast of the running statistics", bcast_peer(comm, 0)):
        comm.Bcast(running, root=0)
    return running


def first_running(run: Run) -> np.ndarray:
    """From the checkpoint resumed, the --init file (default where it has none), or defaults."""
    if run.start is not None and run.start.running is not None:
        return run.start.running
    if run.init_running is not None:
        return run.init_running
    return run.model.init_running()


def record_comm(result: Any, stepper: Any) -> None:
    """Seconds in BatchNorm's allreduces into the result: all steps', and the steady state's."""
    first, later = getattr(stepper.local_gradient, "comm_seconds", (0.0, 0.0))
    result.batchnorm_comm_seconds, result.steady_batchnorm_comm_seconds = first + later, later


def running_of(stepper: Any) -> np.ndarray | None:
    """The running statistics a stepper keeps (None without BatchNorm)."""
    return getattr(stepper.local_gradient, "running", None)


def folded(model: MLP, params: np.ndarray, running: np.ndarray | None,
           eps: float) -> tuple[MLP, np.ndarray]:  # fmt: skip
    """The model without BatchNorm that computes what evaluation mode computes, and its params."""
    # Evaluation normalises with the running statistics: an affine map per feature, folded into
    # W and b: W' = W s, b' = (b - running_mean) s + beta, s = gamma / sqrt(running_var + eps).
    if model.batchnorm == "none" or running is None:
        return model, params
    plain = MLP(model.sizes, model.activation, model.loss, model.dtype)
    flat = np.empty(plain.n_params, model.dtype)
    views, out, stats = model.views(params), plain.views(flat), model.running_views(running)
    for layer in range(model.n_layers):
        W, b = views[f"W{layer}"], views[f"b{layer}"]
        if not model.normalised(layer):
            out[f"W{layer}"][...], out[f"b{layer}"][...] = W, b
            continue
        mean, var = stats[f"running_mean{layer}"], stats[f"running_var{layer}"]
        scale = views[f"gamma{layer}"] / np.sqrt(var.astype(np.float64) + eps)
        out[f"W{layer}"][...] = W * scale
        out[f"b{layer}"][...] = (b - mean) * scale + views[f"beta{layer}"]
    return plain, flat


def evaluate(model: MLP, params: np.ndarray, running: np.ndarray | None, eps: float,
             X: np.ndarray, y: np.ndarray) -> tuple[float, float]:  # fmt: skip
    """(mean loss, accuracy) over X, y in evaluation mode (BatchNorm's running statistics)."""
    from syncsgd.nn.kernels import evaluate as evaluate_plain

    plain, flat = folded(model, params, running, eps)
    return evaluate_plain(plain, flat, X, y)
