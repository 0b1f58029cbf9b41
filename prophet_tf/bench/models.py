"""Models and synthetic data for the training benchmark (``python -m prophet_tf.bench.train``).

Every model has two default sizes: one for ``--compute real`` (this machine's CPU runs the
model, so inputs are small) and one for ``--compute emulated`` (the real parameter shapes; the
compute runs on an emulated accelerator, see :mod:`prophet_tf.bench.emulated`):

* ``resnet50``, ``vgg16``: 32x32 images and 10 classes for real compute; 224x224 and 1000
  classes (25.6M / 138.4M parameters) for emulated compute.
* ``transformer``: the small encoder below (both modes).
* ``bert_base``: a BERT-base-sized encoder (12 blocks, d=768, 12 heads, FFN 3072, vocabulary
  30522, 512 positions, 2 token types, embedding LayerNorm, pooler; 109.5M parameters) over 128
  tokens. Meant for emulated compute: its token embedding is a lookup, whose gradient is sparse
  under real compute (the emulated gradient is dense, as ``sparse_as_dense`` makes it in
  Horovod/BytePS BERT training).

Real-compute sizes, built with random weights (nothing is downloaded):

* ``resnet50``: ``keras.applications.ResNet50(weights=None, classes=10)`` on 32x32 RGB images
  (23.6M parameters, 94 MB of float32 gradients, many small tensors).
* ``vgg16``: ``keras.applications.VGG16(weights=None, classes=10)`` on 32x32 RGB images
  (33.6M parameters, 134 MB of gradients; 56% of them in the two 4096-wide dense layers at the
  end, which backpropagation produces first and the next forward pass needs last).
* ``transformer``: a stack of Transformer encoder blocks (``MultiHeadAttention`` + feed-forward
  + ``LayerNormalization``, post-norm, residuals) over synthetic token ids, mean-pooled into a
  10-way classifier.

The Transformer embeds tokens with :class:`DenseEmbedding` (one-hot times a matrix) instead of
``keras.layers.Embedding``: the latter's gradient is a ``tf.IndexedSlices``, which every system
reduces differently (all-gather of rows vs dense), so the bytes on the wire, and the lower bound,
would differ between systems. With a dense embedding every system moves exactly
:func:`gradient_bytes` per step.

Data is synthetic, generated in-process from a fixed seed (:func:`synthetic_batch`); one batch is
repeated, so input cost is negligible and identical for every system.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

__all__ = ["MODEL_NAMES", "COMPUTE_MODES", "ModelConfig", "DEFAULT_CONFIGS", "EMULATED_CONFIGS",
           "DenseEmbedding", "build_model", "build_transformer", "synthetic_batch", "gradient_bytes", "parameter_count",
           "config_for", "loss_name", "make_optimizer"]

#: Models known to the benchmark, in the order they are run.
MODEL_NAMES = ("resnet50", "vgg16", "transformer", "bert_base")
#: ``--compute`` modes.
COMPUTE_MODES = ("real", "emulated")
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Size parameters of a benchmark model (the ones not used by a model are ignored).

    Attributes:
      name: one of :data:`MODEL_NAMES`.
      image_size: height = width of the input images (CNNs).
      seq_len: tokens per example (Transformer).
      vocab: vocabulary size (Transformer).
      d_model: width of the Transformer.
      heads: attention heads (``key_dim = d_model // heads``).
      ff: hidden width of the feed-forward block.
      blocks: number of encoder blocks.
      classes: number of output classes.
      positions: rows of the position embedding (0: ``seq_len``); the first ``seq_len`` are used.
      token_types: rows of a token-type embedding (0: none); every token has type 0.
      embedding_norm: LayerNormalization after the embeddings (BERT).
      pooler: a ``tanh`` Dense layer on the first token before the classifier (BERT) instead of
        mean pooling.
      embedding: ``"dense"`` (one-hot x matrix: dense gradient) or ``"lookup"``
        (``keras.layers.Embedding``).
    """

    name: str
    image_size: int = 32
    seq_len: int = 64
    vocab: int = 512
    d_model: int = 256
    heads: int = 4
    ff: int = 1024
    blocks: int = 4
    classes: int = NUM_CLASSES
    positions: int = 0
    token_types: int = 0
    embedding_norm: bool = False
    pooler: bool = False
    embedding: str = "dense"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_BERT_BASE = ModelConfig("bert_base", seq_len=128, vocab=30522, d_model=768, heads=12, ff=3072,
                         blocks=12, positions=512, token_types=2, embedding_norm=True,
                         pooler=True, embedding="lookup")
_TRANSFORMER = ModelConfig("transformer", seq_len=64, vocab=512, d_model=256, heads=4, ff=1024,
                           blocks=4)

#: Default configuration of every model under real compute (this machine's CPU).
DEFAULT_CONFIGS: dict[str, ModelConfig] = {
    "resnet50": ModelConfig("resnet50", image_size=32),
    "vgg16": ModelConfig("vgg16", image_size=32),
    "transformer": _TRANSFORMER,
    "bert_base": _BERT_BASE,
}

#: Default configuration under emulated compute: the real parameter shapes.
EMULATED_CONFIGS: dict[str, ModelConfig] = {
    "resnet50": ModelConfig("resnet50", image_size=224, classes=1000),
    "vgg16": ModelConfig("vgg16", image_size=224, classes=1000),
    "transformer": _TRANSFORMER,
    "bert_base": _BERT_BASE,
}


def config_for(name: str, compute: str = "real", **overrides: Any) -> ModelConfig:
    """The default :class:`ModelConfig` of ``name`` for ``compute`` with ``overrides`` applied."""
    if compute not in COMPUTE_MODES:
        raise ValueError(f"unknown compute mode {compute!r}; choose from "
                         f"{', '.join(COMPUTE_MODES)}")
    configs = EMULATED_CONFIGS if compute == "emulated" else DEFAULT_CONFIGS
    if name not in configs:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}")
    return dataclasses.replace(configs[name], **overrides)


def _keras():
    import keras  # lazy: the orchestrator never needs TensorFlow
    return keras


def _dense_embedding_class():
    keras = _keras()

    class _DenseEmbedding(keras.layers.Layer):
        """Token embedding as ``one_hot(ids) @ W``: same result as ``Embedding``, dense gradient."""

        def __init__(self, vocab: int, dim: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.vocab, self.dim = int(vocab), int(dim)

        def build(self, input_shape: Any) -> None:
            self.embeddings = self.add_weight(
                name="embeddings", shape=(self.vocab, self.dim),
                initializer=keras.initializers.RandomNormal(stddev=0.02))

        def call(self, ids: Any) -> Any:
            ops = keras.ops
            one_hot = ops.one_hot(ops.cast(ids, "int32"), self.vocab, dtype=self.compute_dtype)
            return ops.matmul(one_hot, self.embeddings)

        def compute_output_shape(self, input_shape: Any) -> tuple:
            return tuple(input_shape) + (self.dim,)

        def get_config(self) -> dict:
            return {**super().get_config(), "vocab": self.vocab, "dim": self.dim}

    return _DenseEmbedding


_DENSE_EMBEDDING: Optional[type] = None


def DenseEmbedding(vocab: int, dim: int, **kwargs: Any):  # noqa: N802 - used like a class
    """A Keras layer mapping token ids ``[B, T]`` to ``[B, T, dim]`` with a dense gradient."""
    global _DENSE_EMBEDDING
    if _DENSE_EMBEDDING is None:
        _DENSE_EMBEDDING = _dense_embedding_class()
    return _DENSE_EMBEDDING(vocab, dim, **kwargs)


def _encoder_block(x: Any, cfg: ModelConfig, i: int) -> Any:
    layers = _keras().layers
    attn = layers.MultiHeadAttention(cfg.heads, cfg.d_model // cfg.heads,
                                     name=f"block{i}_mha")(x, x)
    x = layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln1")(layers.Add()([x, attn]))
    h = layers.Dense(cfg.ff, activation="gelu", name=f"block{i}_ff1")(x)
    h = layers.Dense(cfg.d_model, name=f"block{i}_ff2")(h)
    return layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln2")(layers.Add()([x, h]))


def _learned_add_class():
    keras = _keras()

    class _LearnedAdd(keras.layers.Layer):
        """Adds rows of a learned table ``[rows, D]`` to ``[B, T, D]``: row t to token t
        (positions), or row 0 to every token (``same_row``: token types, all of type 0)."""

        def __init__(self, rows: int, weight_name: str, same_row: bool = False,
                     **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.rows, self.weight_name, self.same_row = int(rows), weight_name, bool(same_row)

        def build(self, input_shape: Any) -> None:
            self.table = self.add_weight(
                name=self.weight_name, shape=(self.rows, int(input_shape[-1])),
                initializer=keras.initializers.RandomNormal(stddev=0.02))

        def call(self, x: Any) -> Any:
            if self.same_row:
                return x + self.table[0]
            return x + self.table[:keras.ops.shape(x)[1]]

    return _LearnedAdd


def build_transformer(cfg: ModelConfig) -> Any:
    """``cfg.blocks`` post-norm encoder blocks over ``cfg.seq_len`` token ids and a classifier
    (the small ``transformer`` and ``bert_base``; see :class:`ModelConfig`)."""
    keras = _keras()
    layers = keras.layers
    if cfg.d_model % cfg.heads:
        raise ValueError(f"d_model {cfg.d_model} must be divisible by heads {cfg.heads}")
    if cfg.embedding not in ("dense", "lookup"):
        raise ValueError(f"embedding must be 'dense' or 'lookup', got {cfg.embedding!r}")
    if cfg.positions and cfg.positions < cfg.seq_len:
        raise ValueError(f"positions {cfg.positions} must be >= seq_len {cfg.seq_len}")
    ids = keras.Input(shape=(cfg.seq_len,), dtype="int32", name="token_ids")
    if cfg.embedding == "dense":
        x = DenseEmbedding(cfg.vocab, cfg.d_model, name="token_embedding")(ids)
    else:
        x = layers.Embedding(cfg.vocab, cfg.d_model, name="token_embedding")(ids)
    learned_add = _learned_add_class()
    x = learned_add(cfg.positions or cfg.seq_len, "positions", name="position_embedding")(x)
    if cfg.token_types:
        x = learned_add(cfg.token_types, "token_types", same_row=True,
                        name="token_type_embedding")(x)
    if cfg.embedding_norm:
        x = layers.LayerNormalization(epsilon=1e-12, name="embedding_ln")(x)
    for i in range(cfg.blocks):
        x = _encoder_block(x, cfg, i)
    if cfg.pooler:
        x = layers.Lambda(lambda t: t[:, 0], name="first_token")(x)
        x = layers.Dense(cfg.d_model, activation="tanh", name="pooler")(x)
    else:
        x = layers.GlobalAveragePooling1D(name="pool")(x)
    out = layers.Dense(cfg.classes, activation="softmax", name="classifier")(x)
    return keras.Model(ids, out, name=cfg.name)


def build_model(cfg: ModelConfig) -> Any:
    """Builds the (uncompiled) Keras model described by ``cfg`` with random weights."""
    keras = _keras()
    shape = (cfg.image_size, cfg.image_size, 3)
    if cfg.name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=cfg.classes)
    if cfg.name == "vgg16":
        return keras.applications.VGG16(weights=None, input_shape=shape, classes=cfg.classes)
    if cfg.name in ("transformer", "bert_base"):
        return build_transformer(cfg)
    raise ValueError(f"unknown model {cfg.name!r}; choose from {', '.join(MODEL_NAMES)}")


def synthetic_batch(cfg: ModelConfig, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One batch of random inputs and labels for ``cfg`` (deterministic for a given seed)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, cfg.classes, size=(batch,)).astype(np.int32)
    if cfg.name in ("transformer", "bert_base"):
        x = rng.integers(0, cfg.vocab, size=(batch, cfg.seq_len)).astype(np.int32)
    else:
        x = rng.random((batch, cfg.image_size, cfg.image_size, 3), dtype=np.float32)
    return x, labels


def parameter_count(model: Any) -> int:
    """Number of trainable parameters."""
    return int(sum(int(np.prod(w.shape)) for w in model.trainable_weights))


def gradient_bytes(model: Any) -> int:
    """Bytes of one full set of gradients (trainable weights, at their dtypes)."""
    total = 0
    for w in model.trainable_weights:
        itemsize = np.dtype(getattr(w.dtype, "name", w.dtype)).itemsize
        total += int(np.prod(w.shape)) * itemsize
    return total


def loss_name(cfg: ModelConfig) -> str:
    """The Keras loss used for ``cfg`` (all models end in a softmax over class ids)."""
    del cfg
    return "sparse_categorical_crossentropy"


def make_optimizer() -> Any:
    """SGD with momentum: one slot per variable, cheap, the same for every system."""
    return _keras().optimizers.SGD(learning_rate=1e-3, momentum=0.9)

