"""The networks people name, as --model specs: a preset is a word that expands to its layers.

  lenet5      LeCun, Bottou, Bengio and Haffner (1998), "Gradient-based learning applied to
              document recognition": two tanh convolutions with average pooling, then 120, 84
  simple-cnn  the Simple CNN of Shallue et al. (2019), "Measuring the effects of data parallelism
              on neural network training" (the TensorFlow MNIST tutorial's network): two 5 x 5
              ReLU convolutions of 32 and 64 channels, each with 2 x 2 max pooling, then 1024
Both expect 28 x 28 one-channel images (MNIST): the first convolution pads by 2 ("same").
  gpt(layers=L, d=D, heads=H)  a decoder-only transformer on token data (a GPT in the manner of
              Radford et al. 2018): token and position embeddings of width D, L pre-LayerNorm
              blocks of H causal attention heads, a last LayerNorm, then a dense layer per
              position to the vocabulary
"""

from __future__ import annotations

import re

PRESETS = {
    "lenet5": "conv(6, 5, pad=2) tanh avgpool(2) conv(16, 5) tanh avgpool(2) flatten "
    "dense(120) tanh dense(84) tanh dense",
    "simple-cnn": "conv(32, 5, pad=2) relu maxpool(2) conv(64, 5, pad=2) relu maxpool(2) flatten "
    "dense(1024) relu dense",
}


_GPT = re.compile(r"\bgpt\(([^()]*)\)")
GPT_ARGUMENTS = ("layers", "d", "heads")
MAX_GPT_LAYERS = 10_000  # the expansion writes one block per layer: a bound on the spec's length


def gpt(arguments: str) -> str:
    """The layers of gpt(layers=L, d=D, heads=H); ValueError naming what is wrong."""
    given: dict[str, int] = {}
    for part in filter(None, (piece.strip() for piece in arguments.split(","))):
        key, equals, value = part.partition("=")
        if not equals or key.strip() not in GPT_ARGUMENTS or not value.strip().isdigit():
            raise ValueError(f"--model: gpt({arguments}): write gpt(layers=L, d=D, heads=H)")
        if key.strip() in given:
            raise ValueError(f"--model: gpt({arguments}): {key.strip()} is given twice")
        given[key.strip()] = int(value)
    missing = [name for name in GPT_ARGUMENTS if name not in given]
    if missing:
        raise ValueError(f"--model: gpt({arguments}) needs {', '.join(missing)} "
                         "(gpt(layers=L, d=D, heads=H))")  # fmt: skip
    if given["layers"] > MAX_GPT_LAYERS:
        raise ValueError(f"--model: gpt({arguments}): at most {MAX_GPT_LAYERS} layers, got "
                         f"{given['layers']}")  # fmt: skip
    d, heads = given["d"], given["heads"]
    blocks = [f"block({d},{heads})"] * given["layers"]
    return " ".join([f"embed({d})", *blocks, "layernorm", "dense"])


def expand(spec: str) -> str:
    """The spec with every preset replaced by its layers."""
    spec = _GPT.sub(lambda match: gpt(match.group(1)), spec)
    return " ".join(PRESETS.get(word, word) for word in spec.split(" "))


def preset_help() -> str:
    """The presets and what they expand to, for --help."""
    fixed = "; ".join(f"{name} = {layers}" for name, layers in PRESETS.items())
    return (f"{fixed}; gpt(layers=L, d=D, heads=H) = embed(D), L x block(D, H), layernorm, "
            "dense (token data)")
