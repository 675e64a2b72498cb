"""The serial oracle: plain-NumPy large-batch SGD written from its definition, sharing no code.

It does not import syncsgd (no kernels, no optimizer, no data order, no communicator): its forward
and backward passes are whole-batch NumPy matmuls, and its sample order, learning-rate schedule and
update are written out again from their definitions. The integration tests train with syncsgd on P
ranks and compare with `serial_sgd`. Parameters are dicts of arrays W0, b0, W1, b1, ...; W{l} has
shape (fan_in, fan_out) and b{l} shape (fan_out,). With BatchNorm every hidden layer l also has
gamma{l} and beta{l} (fan_out,), and the statistics are over the whole batch (Ioffe and Szegedy's
training mode; its backward pass is their chain rule, step by step).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np


def layer_count(params: Mapping[str, np.ndarray]) -> int:
    """Number of dense layers in a parameter dict W0, b0, W1, b1, ..."""
    count = 0
    while f"W{count}" in params:
        count += 1
    normalised = 2 * (count - 1) if "gamma0" in params else 0
    if count == 0 or len(params) != 2 * count + normalised:
        raise ValueError(f"parameters must be W0, b0, W1, b1, ...; got {sorted(params)}")
    return count


def batch_norm(z: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> tuple:
    """Training-mode BatchNorm over the rows of z: (output, what the backward pass needs)."""
    mean = z.mean(axis=0)
    var = ((z - mean) ** 2).mean(axis=0)  # biased, as the normalisation uses
    zhat = (z - mean) / np.sqrt(var + eps)
    return gamma * zhat + beta, (z, mean, var, zhat, gamma, eps)


def batch_norm_backward(dout: np.ndarray, saved: tuple) -> tuple:
    """(dz, dgamma, dbeta) by the chain rule through mean, variance and zhat, one at a time."""
    z, mean, var, zhat, gamma, eps = saved
    n = len(z)
    dzhat = dout * gamma
    dvar = (dzhat * (z - mean)).sum(axis=0) * -0.5 * (var + eps) ** -1.5
    dmean = -(dzhat / np.sqrt(var + eps)).sum(axis=0) + dvar * (-2.0 * (z - mean)).mean(axis=0)
    dz = dzhat / np.sqrt(var + eps) + dvar * 2.0 * (z - mean) / n + dmean / n
    return dz, (dout * zhat).sum(axis=0), dout.sum(axis=0)


def forward(
    params: Mapping[str, np.ndarray], X: np.ndarray, hidden_activation: str, eps: float = 1e-5,
    saved: list | None = None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits of the MLP for the rows of X, and the input of every layer (for the backward pass).

    With BatchNorm (gamma0 in params), `saved` receives each hidden layer's normalisation state.
    """
    inputs = []
    h = X
    layers = layer_count(params)
    for layer in range(layers):
        inputs.append(h)
        z = h @ params[f"W{layer}"] + params[f"b{layer}"]
        if layer == layers - 1:
            return z, inputs  # the last layer is linear
        if "gamma0" in params:
            z, state = batch_norm(z, params[f"gamma{layer}"], params[f"beta{layer}"], eps)
            if saved is not None:
                saved.append(state)
        h = np.maximum(z, 0) if hidden_activation == "relu" else np.tanh(z)
    raise AssertionError("unreachable")


def per_sample_losses(logits: np.ndarray, y: np.ndarray, loss: str) -> np.ndarray:
    """Loss of every sample: softmax cross-entropy with integer labels, or mean squared error."""
    if loss == "xent":
        top = logits.max(axis=1, keepdims=True)
        log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        return log_norm - logits[np.arange(len(y)), y]
    return ((logits - y) ** 2).mean(axis=1)


def loss_and_grad(
    params: Mapping[str, np.ndarray],
    X: np.ndarray,
    y: np.ndarray,
    *,
    hidden_activation: str,
    loss: str,
    eps: float = 1e-5,
    saved: list | None = None,
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean loss over the batch and its gradient (dict like params), by whole-batch backprop."""
    batch = len(X)
    saved = [] if saved is None else saved
    logits, inputs = forward(params, X, hidden_activation, eps, saved)
    losses = per_sample_losses(logits, y, loss)
    # d loss_i / d logits_i, per sample (not yet divided by the batch size)
    if loss == "xent":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        dz = shifted / shifted.sum(axis=1, keepdims=True)
        dz[np.arange(batch), y] -= 1
    else:
        dz = 2 * (logits - y) / logits.shape[1]
    sums: dict[str, np.ndarray] = {}
    for layer in reversed(range(len(inputs))):
        sums[f"W{layer}"] = inputs[layer].T @ dz
        sums[f"b{layer}"] = dz.sum(axis=0)
        if layer > 0:
            dh = dz @ params[f"W{layer}"].T
            h = inputs[layer]  # = act(z) of the layer below
            dz = dh * (h > 0) if hidden_activation == "relu" else dh * (1 - h * h)
            if saved:  # through the layer below's BatchNorm
                dz, sums[f"gamma{layer - 1}"], sums[f"beta{layer - 1}"] = batch_norm_backward(
                    dz, saved[layer - 1])
    # the mean over the global batch: sum of per-sample gradients, divided once by B
    grads = {name: sums[name] / batch for name in params}
    return float(losses.sum()) / batch, grads


# --- networks of a --model spec, layer by layer: names "<position>.<PyTorch name>" ------------


def read_spec(spec: str, with_args: bool = False) -> list:
    """(kind, width or None) of every layer of a spec such as "dense(8) relu dense"; with_args:
    (kind, positional arguments, key=value arguments) of "conv(4, 3, pad=1)" and the like."""
    layers: list = []
    for kind, inside in re.findall(r"([^\s(]+)(?:\(([^()]*)\))?", spec):
        args, kwargs = [], {}
        for part in filter(None, (piece.strip() for piece in inside.split(","))):
            key, equals, value = part.partition("=")
            if equals:
                kwargs[key.strip()] = int(value)
            else:
                args.append(int(part))
        if with_args:
            layers.append((kind, tuple(args), kwargs))
        else:
            layers.append((kind, args[0] if args else None))
    return layers


# the arguments of the convolutional layers, by name, with their defaults (None: the kernel's)
SIGNATURES = {"conv": (("out_channels", None), ("kernel", None), ("stride", 1), ("pad", 0)),
              "maxpool": (("k", None), ("stride", None)),
              "avgpool": (("k", None), ("stride", None)),
              "block": (("d", None), ("heads", None))}  # fmt: skip


def named_args(kind: str, args: tuple = (), kwargs: Mapping | None = None) -> dict:
    """A layer's arguments by name, the defaults filled in (a pool's stride: its k)."""
    names = SIGNATURES.get(kind, ())
    named = {name: default for name, default in names}
    named.update(zip([name for name, _ in names], args, strict=False))
    named.update(kwargs or {})
    if kind in ("maxpool", "avgpool") and named["stride"] is None:
        named["stride"] = named["k"]
    return named


def windows(x: np.ndarray, k: int, stride: int, pad: int = 0):
    """(i, j, the (n, c, k, k) window of output position (i, j)) over a zero-padded NCHW x."""
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    out_h = (padded.shape[2] - k) // stride + 1
    out_w = (padded.shape[3] - k) // stride + 1
    for i in range(out_h):
        for j in range(out_w):
            rows, cols = slice(i * stride, i * stride + k), slice(j * stride, j * stride + k)
            yield i, j, padded[:, :, rows, cols], (rows, cols)


def pooled_shape(x: np.ndarray, channels: int, k: int, stride: int, pad: int = 0) -> tuple:
    """(n, channels, H', W') of a window sliding over x."""
    return (len(x), channels, (x.shape[2] + 2 * pad - k) // stride + 1,
            (x.shape[3] + 2 * pad - k) // stride + 1)


def layer_forward(kind: str, p: Mapping[str, np.ndarray], x: np.ndarray,
                  args: Mapping | None = None) -> np.ndarray:
    """One layer's output, as torch.nn.Linear, ReLU, Tanh, Conv2d, MaxPool2d, AvgPool2d and
    Flatten compute it; `args`: the layer's arguments by name (`named_args`)."""
    a = args or {}
    if kind == "conv":  # y[n, o, i, j] = sum over c, a, b of W[o, c, a, b] window[n, c, a, b]
        k, stride, pad = p["weight"].shape[2], a.get("stride", 1), a.get("pad", 0)
        y = np.zeros(pooled_shape(x, len(p["weight"]), k, stride, pad))
        for i, j, window, _ in windows(x, k, stride, pad):
            y[:, :, i, j] = np.einsum("ncab,ocab->no", window, p["weight"]) + p["bias"]
        return y
    if kind in ("maxpool", "avgpool"):
        k, stride = a["k"], a["stride"]
        y = np.zeros(pooled_shape(x, x.shape[1], k, stride))
        for i, j, window, _ in windows(x, k, stride):
            flat = window.reshape(*window.shape[:2], k * k)
            y[:, :, i, j] = flat.max(axis=2) if kind == "maxpool" else flat.sum(axis=2) / (k * k)
        return y
    if kind == "flatten":
        return x.reshape(len(x), -1)
    if kind == "dense":  # on the last axis: per position of a sequence
        return x @ p["weight"].T + p["bias"]
    if kind == "embed":
        return p["tok.weight"][x.astype(np.int64)] + p["pos.weight"][None]
    if kind == "layernorm":
        return layer_norm(x, p["weight"], p["bias"])[0]
    if kind == "gelu":
        return x * normal_cdf(x)
    if kind == "block":
        return block_forward(p, x, a["heads"])[0]
    if kind == "relu":
        return np.maximum(x, 0)
    if kind == "tanh":
        return np.tanh(x)
    raise ValueError(f"the oracle has no layer {kind!r}")


def layer_backward(kind: str, p: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                   dy: np.ndarray,
                   args: Mapping | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(sums of the parameters' per-sample gradients, gradient at the input) of one layer."""
    a = args or {}
    if kind == "conv":  # every output position: its window's share of both
        k, stride, pad = p["weight"].shape[2], a.get("stride", 1), a.get("pad", 0)
        dweight = np.zeros(p["weight"].shape)
        dpadded = np.zeros((*x.shape[:2], x.shape[2] + 2 * pad, x.shape[3] + 2 * pad))
        for i, j, window, (rows, cols) in windows(x, k, stride, pad):
            dweight += np.einsum("no,ncab->ocab", dy[:, :, i, j], window)
            dpadded[:, :, rows, cols] += np.einsum("no,ocab->ncab", dy[:, :, i, j], p["weight"])
        dx = dpadded[:, :, pad : pad + x.shape[2], pad : pad + x.shape[3]]
        return {"weight": dweight, "bias": dy.sum(axis=(0, 2, 3))}, dx
    if kind in ("maxpool", "avgpool"):
        k, stride = a["k"], a["stride"]
        dx = np.zeros(x.shape)
        for i, j, window, (rows, cols) in windows(x, k, stride):
            share = np.zeros(window.shape)
            if kind == "avgpool":
                share[...] = (dy[:, :, i, j] / (k * k))[:, :, None, None]
            else:  # to the first maximum in row-major order
                flat = window.reshape(*window.shape[:2], k * k)
                first = flat.argmax(axis=2)
                n, c = np.indices(first.shape)
                share[n, c, first // k, first % k] = dy[:, :, i, j]
            dx[:, :, rows, cols] += share
        return {}, dx
    if kind == "flatten":
        return {}, dy.reshape(x.shape)
    if kind == "dense":  # every position of every sample a row
        dy_rows, x_rows = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        return {"weight": dy_rows.T @ x_rows, "bias": dy_rows.sum(axis=0)}, dy @ p["weight"]
    if kind == "embed":  # scatter-add by token id
        dtok = np.zeros(p["tok.weight"].shape)
        np.add.at(dtok, x.astype(np.int64).reshape(-1), dy.reshape(-1, dy.shape[-1]))
        return {"tok.weight": dtok, "pos.weight": dy.sum(axis=0)}, np.zeros(x.shape)
    if kind == "layernorm":
        _, saved = layer_norm(x, p["weight"], p["bias"])
        dx, dweight, dbias = layer_norm_backward(dy, p["weight"], saved)
        return {"weight": dweight, "bias": dbias}, dx
    if kind == "gelu":
        return {}, dy * (normal_cdf(x) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi))
    if kind == "block":
        return block_backward(p, x, dy, a["heads"])
    if kind == "relu":
        return {}, dy * (y > 0)
    if kind == "tanh":
        return {}, dy * (1 - y * y)
    raise ValueError(f"the oracle has no layer {kind!r}")


def network_loss_and_grad(spec: str, params: Mapping[str, np.ndarray], X: np.ndarray,
                          y: np.ndarray, loss: str, eps: float = 1e-5,
                          saved: dict | None = None,
                          in_shape: tuple | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """Mean loss over the batch and its gradient, layer by layer through the spec.

    A batchnorm layer normalises over the whole batch (after a conv: per channel over N·H·W);
    `saved` receives its state by position. `in_shape`: one sample's shape, (C, H, W) for a
    convolutional network (the rows of X are reshaped to it).
    """
    if in_shape is not None:
        X = np.reshape(X, (len(X), *in_shape))
    layers = read_spec(spec)
    arguments = [named_args(kind, args, kwargs) for kind, args, kwargs in read_spec(spec, True)]
    per_layer = [{name.partition(".")[2]: value for name, value in params.items()
                  if name.partition(".")[0] == str(position)}
                 for position in range(len(layers))]
    saved = {} if saved is None else saved
    outputs = [X]
    for position, ((kind, _), p) in enumerate(zip(layers, per_layer, strict=True)):
        if kind == "batchnorm" and outputs[-1].ndim == 4:  # per channel over N·H·W
            out, saved[position] = batch_norm(channel_rows(outputs[-1]), p["weight"], p["bias"],
                                              eps)  # fmt: skip
            outputs.append(from_channel_rows(out, outputs[-1].shape))
        elif kind == "batchnorm":
            out, saved[position] = batch_norm(outputs[-1], p["weight"], p["bias"], eps)
            outputs.append(out)
        else:
            outputs.append(layer_forward(kind, p, outputs[-1], arguments[position]))
    logits = outputs[-1]
    # one loss term per position (a sequence's: its T tokens), the mean over all B x T of them
    batch = logits.size // logits.shape[-1]
    if loss == "xent":
        rows = logits.reshape(batch, -1)
        shifted = np.exp(rows - rows.max(axis=1, keepdims=True))
        delta = shifted / shifted.sum(axis=1, keepdims=True)
        delta[np.arange(batch), np.reshape(y, -1)] -= 1
        delta = delta.reshape(logits.shape)
    else:
        delta = 2 * (logits - y) / logits.shape[1]
    grads = {}
    for position in reversed(range(len(layers))):
        if position in saved and delta.ndim == 4:
            rows, dweight, dbias = batch_norm_backward(channel_rows(delta), saved[position])
            delta, sums = from_channel_rows(rows, delta.shape), {"weight": dweight, "bias": dbias}
        elif position in saved:
            delta, dweight, dbias = batch_norm_backward(delta, saved[position])
            sums = {"weight": dweight, "bias": dbias}
        else:
            sums, delta = layer_backward(layers[position][0], per_layer[position],
                                         outputs[position], outputs[position + 1], delta,
                                         arguments[position])  # fmt: skip
        grads.update({f"{position}.{name}": value / batch for name, value in sums.items()})
    targets = np.reshape(y, batch) if loss == "xent" else y
    mean_loss = float(per_sample_losses(logits.reshape(batch, -1), targets, loss).sum()) / batch
    return mean_loss, {name: grads[name] for name in params if name in grads}


# --- the transformer's layers: LayerNorm, GELU, causal multi-head self-attention, the block ----


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> tuple:
    """LayerNorm over the last axis: (output, what the backward pass needs)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    xhat = (x - mean) / np.sqrt(var + eps)
    return weight * xhat + bias, (x, mean, var, xhat, eps)


def layer_norm_backward(dout: np.ndarray, weight: np.ndarray, saved: tuple) -> tuple:
    """(dx, dweight, dbias) by the chain rule through mean, variance and xhat, per row."""
    x, mean, var, xhat, eps = saved
    width = x.shape[-1]
    dxhat = dout * weight
    dvar = (dxhat * (x - mean)).sum(axis=-1, keepdims=True) * -0.5 * (var + eps) ** -1.5
    dmean = -(dxhat / np.sqrt(var + eps)).sum(axis=-1, keepdims=True) + dvar * (
        -2.0 * (x - mean)).mean(axis=-1, keepdims=True)  # fmt: skip
    dx = dxhat / np.sqrt(var + eps) + dvar * 2.0 * (x - mean) / width + dmean / width
    every_row = tuple(range(x.ndim - 1))
    return dx, (dout * xhat).sum(axis=every_row), dout.sum(axis=every_row)


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, element by element."""
    return 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def heads_of(values: np.ndarray, heads: int) -> np.ndarray:
    """(B, T, d) -> (B, heads, T, d / heads)."""
    b, t, d = values.shape
    return values.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)


def causal_attention(qkv: np.ndarray, heads: int) -> tuple:
    """Scaled dot-product attention of every head, later positions masked: (output, saved)."""
    q, k, v = (heads_of(part, heads) for part in np.split(qkv, 3, axis=-1))
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    future = np.triu(np.ones(scores.shape[-2:], bool), 1)
    scores = np.where(future, -np.inf, scores)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    out = weights @ v
    return out.transpose(0, 2, 1, 3).reshape(qkv.shape[0], qkv.shape[1], -1), (q, k, v, weights)


def causal_attention_backward(dout: np.ndarray, saved: tuple, heads: int) -> np.ndarray:
    """The gradient at [q | k | v] from the gradient at the attention's output."""
    q, k, v, weights = saved
    scale = 1.0 / math.sqrt(q.shape[-1])
    do = heads_of(dout, heads)
    dweights = do @ v.transpose(0, 1, 3, 2)
    dv = weights.transpose(0, 1, 3, 2) @ do
    dscores = weights * (dweights - (weights * dweights).sum(axis=-1, keepdims=True))
    dq, dk = dscores @ k * scale, dscores.transpose(0, 1, 3, 2) @ q * scale
    merged = [part.transpose(0, 2, 1, 3).reshape(dout.shape) for part in (dq, dk, dv)]
    return np.concatenate(merged, axis=-1)


def sub(p: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays of a block's part: "ln1." -> weight, bias."""
    return {name[len(prefix):]: value for name, value in p.items() if name.startswith(prefix)}


def block_forward(p: Mapping[str, np.ndarray], x: np.ndarray, heads: int) -> tuple:
    """x + attn(ln1(x)), then + fc2(gelu(fc1(ln2(.)))): (output, every intermediate)."""
    h1, ln1 = layer_norm(x, p["ln1.weight"], p["ln1.bias"])
    qkv = h1 @ p["attn.in_proj_weight"].T + p["attn.in_proj_bias"]
    att, saved = causal_attention(qkv, heads)
    r = x + att @ p["attn.out_proj.weight"].T + p["attn.out_proj.bias"]
    h2, ln2 = layer_norm(r, p["ln2.weight"], p["ln2.bias"])
    f1 = h2 @ p["fc1.weight"].T + p["fc1.bias"]
    g = f1 * normal_cdf(f1)
    y = r + g @ p["fc2.weight"].T + p["fc2.bias"]
    return y, dict(h1=h1, ln1=ln1, qkv=qkv, att=att, attention=saved, r=r, h2=h2, ln2=ln2,
                   f1=f1, g=g)  # fmt: skip


def block_backward(p: Mapping[str, np.ndarray], x: np.ndarray, dy: np.ndarray,
                   heads: int) -> tuple[dict[str, np.ndarray], np.ndarray]:  # fmt: skip
    """(sums of the block's parameter gradients by name, gradient at x), step by step."""
    _, s = block_forward(p, x, heads)
    sums: dict[str, np.ndarray] = {}

    def linear(inputs: np.ndarray, dout: np.ndarray, weight: str, bias: str):
        grads, dinputs = layer_backward("dense", {"weight": p[weight]}, inputs, None, dout)
        sums[weight], sums[bias] = grads["weight"], grads["bias"]
        return dinputs

    dg = linear(s["g"], dy, "fc2.weight", "fc2.bias")
    df1 = dg * (normal_cdf(s["f1"]) + s["f1"] * np.exp(-s["f1"] ** 2 / 2) / math.sqrt(2 * math.pi))
    dh2 = linear(s["h2"], df1, "fc1.weight", "fc1.bias")
    dr, sums["ln2.weight"], sums["ln2.bias"] = layer_norm_backward(dh2, p["ln2.weight"], s["ln2"])
    dr = dr + dy
    datt = linear(s["att"], dr, "attn.out_proj.weight", "attn.out_proj.bias")
    dqkv = causal_attention_backward(datt, s["attention"], heads)
    dh1 = linear(s["h1"], dqkv, "attn.in_proj_weight", "attn.in_proj_bias")
    dx, sums["ln1.weight"], sums["ln1.bias"] = layer_norm_backward(dh1, p["ln1.weight"], s["ln1"])
    return sums, dx + dr


def channel_rows(values: np.ndarray) -> np.ndarray:
    """(N·H·W, C) rows of an (N, C, H, W) array: one column per channel."""
    return values.transpose(0, 2, 3, 1).reshape(-1, values.shape[1])


def from_channel_rows(rows: np.ndarray, shape: tuple) -> np.ndarray:
    """The (N, C, H, W) array of `channel_rows`."""
    n, c, h, w = shape
    return rows.reshape(n, h, w, c).transpose(0, 3, 1, 2)


def batch_indices(
    step: int, n_samples: int, batch_size: int, seed: int, shuffle: bool
) -> np.ndarray:
    """Sample indices of global batch `step`: epoch step // (N // B), position step % (N // B)."""
    per_epoch = n_samples // batch_size
    epoch = step // per_epoch
    position = step % per_epoch
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(n_samples)
    else:
        order = np.arange(n_samples)
    return order[position * batch_size : (position + 1) * batch_size]


def schedule_lr(
    step: int,
    *,
    lr: float,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int = 1,
    lr_scaling: str = "none",
    base_batch: int = 256,
    batch_size: int = 256,
    noam_dim: int = 1,
) -> float:
    """Learning rate of 0-based step `step`: lr scaling by batch size, then the schedule."""
    if lr_scaling == "linear":
        lr = lr * batch_size / base_batch
    elif lr_scaling == "sqrt":
        lr = lr * math.sqrt(batch_size / base_batch)
    t = step + 1
    if schedule == "constant":
        return lr
    if schedule == "warmup":
        return lr * min(1.0, t / warmup_steps)
    if schedule == "cosine":
        warm = min(1.0, t / warmup_steps) if warmup_steps else 1.0
        return lr * warm * (1 + math.cos(math.pi * step / total_steps)) / 2
    if schedule == "noam":
        return lr / math.sqrt(noam_dim) * min(1 / math.sqrt(t), t / warmup_steps**1.5)
    raise ValueError(f"unknown schedule {schedule!r}")


def sgd_update(
    params: dict[str, np.ndarray],
    grads: dict[str, np.ndarray],
    velocity: dict[str, np.ndarray] | None,
    *,
    rate: float,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None, float]:
    """One update (clip, weight decay, momentum, step); returns new params, velocity, grad norm."""
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    dtype = next(iter(params.values())).dtype.type
    if clip_norm is not None and norm > clip_norm:
        grads = {k: g * dtype(clip_norm / norm) for k, g in grads.items()}
    if weight_decay:
        grads = {k: g + dtype(weight_decay) * params[k] for k, g in grads.items()}
    if momentum:
        if velocity is None:
            velocity = {k: np.zeros_like(g) for k, g in grads.items()}
        velocity = {k: dtype(momentum) * velocity[k] + g for k, g in grads.items()}
        if nesterov:
            directions = {k: g + dtype(momentum) * velocity[k] for k, g in grads.items()}
        else:
            directions = velocity
    else:
        directions = grads
    params = {k: p - dtype(rate) * directions[k] for k, p in params.items()}
    return params, velocity, norm


def tensor_norm(values: np.ndarray) -> float:
    """L2 norm of one tensor, in float64."""
    return math.sqrt(float(np.sum(values.astype(np.float64) ** 2)))


def clipped(grads: dict[str, np.ndarray], clip_norm: float | None) -> tuple[dict, float]:
    """The gradient scaled to global norm `clip_norm` if its norm exceeds it, and that norm."""
    norm = math.sqrt(sum(tensor_norm(g) ** 2 for g in grads.values()))
    dtype = next(iter(grads.values())).dtype.type
    if clip_norm is not None and norm > clip_norm:
        grads = {k: g * dtype(clip_norm / norm) for k, g in grads.items()}
    return grads, norm


def moments(params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
            state: dict | None, betas: tuple[float, float]) -> dict:
    """Adam's step count and moments after this gradient: m <- b1 m + (1 - b1) g,
    v <- b2 v + (1 - b2) g^2 (zeros before the first step)."""
    beta1, beta2 = betas
    if state is None:
        state = {"t": 0, "m": {k: np.zeros_like(p) for k, p in params.items()},
                 "v": {k: np.zeros_like(p) for k, p in params.items()}}  # fmt: skip
    return {"t": state["t"] + 1,
            "m": {k: beta1 * state["m"][k] + (1 - beta1) * g for k, g in grads.items()},
            "v": {k: beta2 * state["v"][k] + (1 - beta2) * g * g for k, g in grads.items()}}


def adam_update(
    params: dict[str, np.ndarray],
    grads: dict[str, np.ndarray],
    state: dict | None,
    *,
    rate: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    clip_norm: float | None = None,
) -> tuple[dict[str, np.ndarray], dict]:
    """One Adam step (Kingma and Ba, Algorithm 1, with PyTorch's ε after the square root of the
    bias-corrected v); `decoupled`: AdamW's θ ← θ − lr wd θ first, else L2 added to g."""
    beta1, beta2 = betas
    grads, _ = clipped(grads, clip_norm)
    if weight_decay and decoupled:
        params = {k: p - rate * weight_decay * p for k, p in params.items()}
    elif weight_decay:  # L2: the moments see g + wd θ
        grads = {k: g + weight_decay * params[k] for k, g in grads.items()}
    state = moments(params, grads, state, betas)
    t, m, v = state["t"], state["m"], state["v"]
    new = {}
    for k, p in params.items():
        m_hat = m[k] / (1 - beta1**t)
        v_hat = v[k] / (1 - beta2**t)
        new[k] = p - rate * m_hat / (np.sqrt(v_hat) + eps)
    return new, {"t": t, "m": m, "v": v}


def lamb_update(
    params: dict[str, np.ndarray],
    grads: dict[str, np.ndarray],
    state: dict | None,
    *,
    rate: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
) -> tuple[dict[str, np.ndarray], dict]:
    """One LAMB step (You et al. 2019, Algorithm 2): per tensor, Adam's direction plus wd θ,
    scaled by ‖θ‖ / ‖that‖ (1 where either norm is 0)."""
    beta1, beta2 = betas
    grads, _ = clipped(grads, clip_norm)
    state = moments(params, grads, state, betas)
    t, m, v = state["t"], state["m"], state["v"]
    new = {}
    for k, p in params.items():
        r = (m[k] / (1 - beta1**t)) / (np.sqrt(v[k] / (1 - beta2**t)) + eps)
        u = r + weight_decay * p
        p_norm, u_norm = tensor_norm(p), tensor_norm(u)
        ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
        new[k] = p - rate * ratio * u
    return new, {"t": t, "m": m, "v": v}


def lars_update(
    params: dict[str, np.ndarray],
    grads: dict[str, np.ndarray],
    velocity: dict[str, np.ndarray] | None,
    *,
    rate: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    clip_norm: float | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """One LARS step (You, Gitman and Ginsburg 2017, Algorithm 1): per tensor the local rate
    η ‖θ‖ / (‖g‖ + wd ‖θ‖) (1 where either norm is 0), v ← μ v + lr λ (g + wd θ), θ ← θ − v."""
    grads, _ = clipped(grads, clip_norm)
    new, new_velocity = {}, {}
    for k, p in params.items():
        g = grads[k]
        p_norm, g_norm = tensor_norm(p), tensor_norm(g)
        if p_norm > 0 and g_norm > 0:
            local = trust_coefficient * p_norm / (g_norm + weight_decay * p_norm)
        else:
            local = 1.0
        step = rate * local * (g + weight_decay * p)
        if momentum:
            step = momentum * (0 if velocity is None else velocity[k]) + step
            new_velocity[k] = step
        new[k] = p - step
    return new, (new_velocity if momentum else None)


def serial_sgd(
    X: np.ndarray,
    y: np.ndarray,
    params: Mapping[str, np.ndarray],
    *,
    hidden_activation: str = "relu",
    loss: str = "xent",
    steps: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    lr: float,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    lr_scaling: str = "none",
    base_batch: int = 256,
    noam_dim: int = 1,
    dtype: np.dtype | type = np.float64,
    bn_eps: float = 1e-5,
    bn_momentum: float = 0.1,
    spec: str | None = None,
    in_shape: tuple | None = None,
    optimizer: str = "sgd",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    trust_coefficient: float = 0.001,
    ranks: int = 1,
    accumulate: int = 1,
) -> tuple[dict[str, np.ndarray], list[float]]:
    """Large-batch SGD on one process; final params and the global-batch mean loss before each step.

    `total_steps` (for the cosine schedule) defaults to `steps`. With BatchNorm (gamma0 in
    `params`) the final params also hold the running statistics, running_mean{l} and
    running_var{l}. With a --model `spec`, the network of that spec (params "0.weight", ...), its
    samples of shape `in_shape` if given (the rows of X reshaped). `optimizer`: sgd, or adam,
    adamw, lamb or lars (with `betas`, `eps`, `weight_decay`, `momentum`, `trust_coefficient`).
    `ranks`, `accumulate`: BatchNorm's statistics over the micro-batches of a run on that many
    ranks with --accumulate (micro_batch_groups), the gradient their sums over B.
    """
    if not 1 <= batch_size <= len(X):
        raise ValueError(f"batch size {batch_size} must be in 1..{len(X)}")
    float_type = np.dtype(dtype)
    theta = {name: np.array(value, dtype=float_type) for name, value in params.items()
             if "running" not in name}
    X = np.asarray(X, dtype=float_type)
    y = np.asarray(y, dtype=np.int64 if loss == "xent" else float_type)
    velocity = None
    losses = []
    running = initial_running(theta) if spec is None else initial_network_running(spec, theta)
    for step in range(steps):
        rows = batch_indices(step, len(X), batch_size, seed, shuffle)
        saved: list = []
        if accumulate > 1:
            value, grads = accumulated_loss_and_grad(
                micro_batch_groups(rows, ranks, accumulate), theta, X, y, running,
                spec=spec, loss=loss, hidden_activation=hidden_activation, eps=bn_eps,
                momentum=bn_momentum, in_shape=in_shape)  # fmt: skip
        elif spec is not None:
            by_position: dict = {}
            value, grads = network_loss_and_grad(spec, theta, X[rows], y[rows], loss, bn_eps,
                                                 by_position, in_shape)
            update_network_running(running, by_position, bn_momentum)
        else:
            value, grads = loss_and_grad(
                theta, X[rows], y[rows], hidden_activation=hidden_activation, loss=loss,
                eps=bn_eps, saved=saved,
            )
        update_running(running, saved, bn_momentum)
        losses.append(value)
        rate = schedule_lr(
            step,
            lr=lr,
            schedule=schedule,
            warmup_steps=warmup_steps,
            total_steps=steps if total_steps is None else total_steps,
            lr_scaling=lr_scaling,
            base_batch=base_batch,
            batch_size=batch_size,
            noam_dim=noam_dim,
        )
        if optimizer in ("adam", "adamw"):
            theta, velocity = adam_update(theta, grads, velocity, rate=rate, betas=betas, eps=eps,
                                          weight_decay=weight_decay,
                                          decoupled=optimizer == "adamw",
                                          clip_norm=clip_norm)  # fmt: skip
            continue
        if optimizer == "lamb":
            theta, velocity = lamb_update(theta, grads, velocity, rate=rate, betas=betas, eps=eps,
                                          weight_decay=weight_decay,
                                          clip_norm=clip_norm)  # fmt: skip
            continue
        if optimizer == "lars":
            theta, velocity = lars_update(theta, grads, velocity, rate=rate, momentum=momentum,
                                          weight_decay=weight_decay,
                                          trust_coefficient=trust_coefficient,
                                          clip_norm=clip_norm)  # fmt: skip
            continue
        theta, velocity, _ = sgd_update(
            theta,
            grads,
            velocity,
            rate=rate,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            clip_norm=clip_norm,
        )
    return {**theta, **running}, losses


def micro_batch_groups(rows: np.ndarray, ranks: int, accumulate: int) -> list[np.ndarray]:
    """The batch's micro-batches as the ranks run them: micro-batch k is every rank's k-th
    piece of its shard (numpy.array_split of the batch into shards, of each shard into pieces)."""
    pieces = [np.array_split(shard, accumulate) for shard in np.array_split(rows, ranks)]
    return [np.concatenate([own[k] for own in pieces]) for k in range(accumulate)]


def accumulated_loss_and_grad(groups: list[np.ndarray], theta: dict, X: np.ndarray,
                              y: np.ndarray, running: dict, *, spec: str | None, loss: str,
                              hidden_activation: str, eps: float, momentum: float,
                              in_shape: tuple | None) -> tuple[float, dict]:  # fmt: skip
    """Mean loss and gradient of a batch from its micro-batches' sums; BatchNorm's statistics
    (and its running statistics, moved once per micro-batch) are each micro-batch's own."""
    batch = sum(len(group) for group in groups)
    loss_sum, sums = 0.0, {name: np.zeros_like(value) for name, value in theta.items()}
    for group in groups:
        if not len(group):
            continue  # no sample: no gradient, and BatchNorm's statistics stay
        saved: list = []
        if spec is not None:
            by_position: dict = {}
            value, grads = network_loss_and_grad(spec, theta, X[group], y[group], loss, eps,
                                                 by_position, in_shape)  # fmt: skip
            update_network_running(running, by_position, momentum)
        else:
            value, grads = loss_and_grad(theta, X[group], y[group],
                                         hidden_activation=hidden_activation, loss=loss,
                                         eps=eps, saved=saved)  # fmt: skip
            update_running(running, saved, momentum)
        loss_sum += value * len(group)
        for name, mean in grads.items():
            sums[name] += mean * len(group)
    return loss_sum / batch, {name: total / batch for name, total in sums.items()}


def initial_running(params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """PyTorch's first running statistics: mean 0 and variance 1 per feature of each BN layer."""
    running = {}
    for name, gamma in params.items():
        if name.startswith("gamma"):
            layer = name.removeprefix("gamma")
            running[f"running_mean{layer}"] = np.zeros_like(gamma)
            running[f"running_var{layer}"] = np.ones_like(gamma)
    return running


def initial_network_running(spec: str, params: Mapping[str, np.ndarray]) -> dict:
    """"<position>.running_mean" 0 and "<position>.running_var" 1 of every batchnorm layer."""
    running = {}
    for position, (kind, _) in enumerate(read_spec(spec)):
        if kind == "batchnorm":
            weight = params[f"{position}.weight"]
            running[f"{position}.running_mean"] = np.zeros_like(weight)
            running[f"{position}.running_var"] = np.ones_like(weight)
    return running


def update_network_running(running: dict, saved: dict, momentum: float) -> None:
    """The running statistics of a network's batchnorm layers after one step, as PyTorch's."""
    for position, state in saved.items():
        move_running(running, f"{position}.running_mean", f"{position}.running_var", state,
                     momentum)


def update_running(running: dict[str, np.ndarray], saved: list, momentum: float) -> None:
    """running = (1 - momentum) running + momentum batch; the batch variance unbiased (n >= 2)."""
    for layer, state in enumerate(saved):
        move_running(running, f"running_mean{layer}", f"running_var{layer}", state, momentum)


def move_running(running: dict, mean_name: str, var_name: str, state: tuple,
                 momentum: float) -> None:
    """One layer's running mean and variance after a batch normalised with `state`."""
    z, mean, var, *_ = state
    n = len(z)
    old_mean = running[mean_name]
    running[mean_name] = ((1 - momentum) * old_mean + momentum * mean).astype(old_mean.dtype)
    if n >= 2:
        old_var = running[var_name]
        running[var_name] = (
            (1 - momentum) * old_var + momentum * var * n / (n - 1)).astype(old_var.dtype)


def evaluation_loss(params: Mapping[str, np.ndarray], X: np.ndarray, y: np.ndarray, *,
                    hidden_activation: str, loss: str, eps: float = 1e-5) -> float:
    """Mean loss in evaluation mode: BatchNorm normalises with the running statistics."""
    h = X
    layers = sum(1 for name in params if name.startswith("W"))
    for layer in range(layers):
        z = h @ params[f"W{layer}"] + params[f"b{layer}"]
        if layer == layers - 1:
            return float(per_sample_losses(z, y, loss).mean())
        if f"gamma{layer}" in params:
            mean, var = params[f"running_mean{layer}"], params[f"running_var{layer}"]
            z = params[f"gamma{layer}"] * (z - mean) / np.sqrt(var + eps) + params[f"beta{layer}"]
        h = np.maximum(z, 0) if hidden_activation == "relu" else np.tanh(z)
    raise AssertionError("unreachable")
