"""The networks people name, as --model specs: a preset is a word that expands to its layers.

  lenet5      LeCun, Bottou, Bengio and Haffner (1998), "Gradient-based learning applied to
              document recognition": two tanh convolutions with average pooling, then 120, 84
  simple-cnn  the Simple CNN of Shallue et al. (2019), "Measuring the effects of data parallelism
              on neural network training" (the TensorFlow MNIST tutorial's network): two 5 x 5
              ReLU convolutions of 32 and 64 channels, each with 2 x 2 max pooling, then 1024
Both expect 28 x 28 one-channel images (MNIST): the first convolution pads by 2 ("same").
"""

from __future__ import annotations

PRESETS = {
    "lenet5": "conv(6, 5, pad=2) tanh avgpool(2) conv(16, 5) tanh avgpool(2) flatten "
    "dense(120) tanh dense(84) tanh dense",
    "simple-cnn": "conv(32, 5, pad=2) relu maxpool(2) conv(64, 5, pad=2) relu maxpool(2) flatten "
    "dense(1024) relu dense",
}


def expand(spec: str) -> str:
    """The spec with every preset word replaced by its layers."""
    return " ".join(PRESETS.get(word, word) for word in spec.split(" "))


def preset_help() -> str:
    """The presets and what they expand to, for --help."""
    return "; ".join(f"{name} = {layers}" for name, layers in PRESETS.items())
