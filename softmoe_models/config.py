"""Model configurations: frozen dataclasses, saved next to the weights and checked on load.

Sizes live in one table, ``VARIANTS``, with the paper's models (Puigcerver et al., Table 1) and
vmoe's Soft MoE settings: MoE in the last half of the blocks, one slot per expert; and the sparse
Tokens Choice and Experts Choice models the paper compares with Soft MoE S/16.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Classifier = Literal["gap", "token", "map"]
# vmoe contrastive TextTransformer.pool_type: the last or first position, the mean (global average),
# the max (global max) over positions, or a MAP head (the only one with parameters, txt/MapHead/*).
TextPool = Literal["last", "first", "gap", "gmp", "map"]
TEXT_POOLS: tuple[str, ...] = get_args(TextPool)
# Compute precision of a model's matmuls (LayerNorm, softmax and the Soft MoE norm stay fp32). One
# list for every layer that offers a choice: `softmoe export`'s --precision and `softmoe serve`'s.
Precision = Literal["fp32", "fp16", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
# What routes tokens to the experts of an MoE block: Soft MoE (vmoe SoftRouter), or vmoe's sparse
# routers as it evaluates them (sparse_moe.py): NoisyTopExpertsPerItemRouter ("tokens-choice") and
# NoisyTopItemsPerExpertRouter ("experts-choice").
Router = Literal["soft", "tokens-choice", "experts-choice"]
ROUTERS: tuple[str, ...] = get_args(Router)
# vmoe's dispatcher dtype: "bfloat16" is its Bfloat16Dispatcher (expert inputs and outputs rounded).
DispatchDtype = Literal["float32", "bfloat16"]
DISPATCH_DTYPES: tuple[str, ...] = get_args(DispatchDtype)
CapacityRounding = Literal["ceil", "round"]  # vmoe capacity_ceil_or_round


@dataclass(frozen=True)
class MoEConfig:
    """Where and how wide the MoE blocks are, and how they route (Soft MoE unless ``router`` says)."""

    layers: tuple[int, ...]  # block indices whose MLP is an MoE layer
    num_experts: int  # n (E)
    slots_per_expert: int = 1  # p, Soft MoE only (a sparse router has capacity, not slots)
    mlp_dim: int | None = None  # expert hidden width; None = the encoder's mlp_dim
    # Routing groups: always one sequence (vmoe's Soft MoE configs set group_size to the tokens
    # of one image, so its groups are images; sparse routers here do the same, so no batch-mate
    # takes an image's capacity). Old configs' group_size: see _drop_group_sizes.
    router: Router = "soft"  # see ROUTERS; "soft" is the Soft MoE layer, the others sparse_moe.py
    experts_per_token: int | None = None  # K, tokens-choice only (vmoe num_selected_experts); None = 1
    capacity_factor: float = 4.0  # sparse only: C = ceil(S*K*cf/E), S tokens per group; 4.0 = vmoe eval
    capacity_rounding: CapacityRounding = "ceil"  # sparse only: vmoe capacity_ceil_or_round
    capacity_multiple_of: int = 4  # sparse only: C rounded up to a multiple of this (vmoe default 4)
    batch_priority: bool = False  # tokens-choice only: claims in descending top-1 gate order (BPR)
    dispatch_dtype: DispatchDtype = "float32"  # "bfloat16": vmoe's Bfloat16Dispatcher (both routers)

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ValueError(f"MoEConfig: {problem}")

    def _problem(self) -> str | None:
        """The first impossible setting, in words; None when the config is consistent."""
        if self.router not in ROUTERS:
            return f"router {self.router!r} is not one of {list(ROUTERS)}"
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            return f"dispatch_dtype {self.dispatch_dtype!r} is not one of {list(DISPATCH_DTYPES)}"
        if self.capacity_rounding not in ("ceil", "round"):
            return f"capacity_rounding {self.capacity_rounding!r} is not 'ceil' or 'round'"
        if self.router != "tokens-choice":
            if self.experts_per_token is not None:
                return (f"experts_per_token (K) is for router 'tokens-choice'; router {self.router!r} "
                        + ("picks tokens per expert" if self.sparse else "has slots, not choices"))
            if self.batch_priority:
                return f"batch_priority orders tokens-choice claims; router {self.router!r} has none"
        elif not 1 <= self.k <= self.num_experts:
            return f"experts_per_token K={self.k} must be between 1 and num_experts={self.num_experts}"
        if self.sparse:
            if self.slots_per_expert != 1:
                return f"slots_per_expert={self.slots_per_expert} is Soft MoE only; router {self.router!r} has capacity"
            if not self.capacity_factor > 0:
                return f"capacity_factor must be > 0, got {self.capacity_factor}"
            if self.capacity_multiple_of < 1:
                return f"capacity_multiple_of must be >= 1, got {self.capacity_multiple_of}"
        elif (self.capacity_factor, self.capacity_rounding, self.capacity_multiple_of) != (4.0, "ceil", 4):
            return ("capacity_factor/capacity_rounding/capacity_multiple_of are for sparse routers; "
                    "router 'soft' has slots")
        return None

    @property
    def sparse(self) -> bool:
        """Whether the MoE layers are vmoe's sparse ones (tokens or experts choice)."""
        return self.router != "soft"

    @property
    def k(self) -> int:
        """Experts per token of tokens-choice (1 when unset)."""
        return 1 if self.experts_per_token is None else self.experts_per_token

    def capacity(self, group_tokens: int) -> int:
        """Expert capacity C for a routing group of ``group_tokens`` tokens (vmoe compute_capacity)."""
        k = self.k if self.router == "tokens-choice" else 1
        return compute_capacity(group_tokens * k, self.num_experts, self.capacity_factor,
                                self.capacity_rounding, self.capacity_multiple_of)

    def check_tokens(self, tokens: int, where: str) -> None:
        """Raise ValueError when experts-choice would pick more tokens than a group of ``tokens`` has."""
        if self.router == "experts-choice" and self.capacity(tokens) > tokens:
            raise ValueError(
                f"{where}: experts-choice capacity {self.capacity(tokens)} exceeds the {tokens} tokens of a "
                f"routing group (capacity_factor={self.capacity_factor}, rounding={self.capacity_rounding!r}, "
                f"multiple_of={self.capacity_multiple_of}); vmoe's top_k fails the same way. Lower the "
                "capacity factor, or use rounding 'round' and multiple_of 1 as vmoe's experts-choice config"
            )


def compute_capacity(num_tokens: int, num_experts: int, capacity_factor: float,
                     rounding: CapacityRounding = "ceil", multiple_of: int = 4) -> int:
    """vmoe ``compute_capacity``: ``num_tokens * cf / E`` in Python float arithmetic (that order),
    ceil (or Python's round, half to even), at least 1, then up to a multiple of ``multiple_of``.

    Args:
        num_tokens: claims per group: S * K for tokens choice, S for experts choice.
        num_experts: E.
        capacity_factor: cf.
        rounding: "ceil" or "round".
        multiple_of: C is rounded up to a multiple of this.
    """
    raw = num_tokens * capacity_factor / num_experts
    capacity = int(math.ceil(raw)) if rounding == "ceil" else int(round(raw))
    if capacity < 1:
        raise ValueError(f"capacity {raw} rounds to {capacity} < 1 (num_tokens={num_tokens}, "
                         f"num_experts={num_experts}, capacity_factor={capacity_factor})")
    return capacity + (-capacity) % multiple_of


@dataclass(frozen=True)
class EncoderConfig:
    """A pre-LN transformer encoder (vmoe ``EncoderMoe``)."""

    hidden_size: int  # D
    num_layers: int
    num_heads: int  # H; head dim = D / H
    mlp_dim: int  # M of the dense blocks
    qk_norm: bool = True  # LayerNorm (scale only) on queries and keys per head
    moe: MoEConfig | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class ViTConfig:
    """vmoe ``VisionTransformerMoe``."""

    encoder: EncoderConfig
    image_size: int = 224  # square input side, pixels
    patch_size: int = 16  # P
    num_classes: int | None = 1000  # None: no head, the model returns pooled features
    classifier: Classifier = "gap"
    representation_size: int | None = None  # pre_logits Dense + tanh when set
    in_channels: int = 3
    map_mlp_dim: int | None = None  # MAP head MLP width (classifier 'map'); None = mlp_dim

    def __post_init__(self) -> None:
        if self.encoder.moe is not None:
            self.encoder.moe.check_tokens(self.num_tokens, "ViTConfig")

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def num_tokens(self) -> int:
        return self.num_patches + (1 if self.classifier == "token" else 0)

    @property
    def feature_dim(self) -> int:
        return self.representation_size or self.encoder.hidden_size


@dataclass(frozen=True)
class TextConfig:
    """vmoe contrastive ``TextTransformer``."""

    encoder: EncoderConfig
    vocab_size: int = 32000
    max_len: int = 16  # L: sequences are padded/truncated to exactly this length
    num_classes: int | None = None  # head output width (the image width); None: no head
    pool_type: TextPool = "last"  # vmoe's default; converters must not assume it (no parameters show it)
    map_mlp_dim: int | None = None  # MAP head MLP width (pool_type 'map'); None = encoder mlp_dim
    # None: every position attends to every position (vmoe, big_vision). An id: keys in the trailing
    # run of this id are masked, as transformers' attention_mask does for a tokenizer that pads with
    # its EOS (the run's first id, the EOS ending the text, is kept).
    padding_mask_id: int | None = None

    def __post_init__(self) -> None:
        if self.pool_type not in TEXT_POOLS:
            raise ValueError(f"TextConfig.pool_type {self.pool_type!r} is not one of {list(TEXT_POOLS)}")
        if self.encoder.moe is not None:
            self.encoder.moe.check_tokens(self.max_len, "TextConfig")


@dataclass(frozen=True)
class TwoTowerConfig:
    """vmoe contrastive ``TwoTower`` (LiT / SigLIP-style)."""

    image: ViTConfig
    text: TextConfig
    has_bias: bool = True  # a learned logit bias ``b`` exists


@dataclass(frozen=True)
class SeqEncoderConfig:
    """Generic Soft MoE sequence encoder (the Axon ``SoftMoE.build`` interface)."""

    embed_dim: int  # input feature width
    hidden_size: int = 256
    num_experts: int = 4
    num_layers: int = 4
    dropout: float = 0.1
    seq_len: int = 60  # window length
    slots_per_expert: int = 1
    expert_mult: int = 4  # expert hidden width = expert_mult * hidden_size


ModelConfig = ViTConfig | TwoTowerConfig | SeqEncoderConfig

_KINDS: dict[type, str] = {
    ViTConfig: "classifier",
    TwoTowerConfig: "two-tower",
    SeqEncoderConfig: "encoder",
}


def kind_of(config: ModelConfig) -> str:
    """Package kind for a config: classifier | two-tower | encoder."""
    return _KINDS[type(config)]


# ---------------------------------------------------------------- (de)serialisation


def to_dict(config: Any) -> dict[str, Any]:
    """A JSON-ready dict (tuples become lists)."""
    return json_ready(dataclasses.asdict(config))


def json_ready(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def _build(cls: type, data: dict[str, Any]) -> Any:
    """Build dataclass ``cls`` from ``data``, strictly: unknown keys are errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        sub = _NESTED.get((cls, name))
        if sub is not None and value is not None:
            value = _build(sub, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a missing required field
        raise ValueError(f"{cls.__name__}: {e}") from None


_NESTED: dict[tuple[type, str], type] = {
    (EncoderConfig, "moe"): MoEConfig,
    (ViTConfig, "encoder"): EncoderConfig,
    (TextConfig, "encoder"): EncoderConfig,
    (TwoTowerConfig, "image"): ViTConfig,
    (TwoTowerConfig, "text"): TextConfig,
}


def from_dict(kind: str, data: dict[str, Any]) -> ModelConfig:
    """Inverse of ``to_dict`` for a package of the given kind."""
    for cls, name in _KINDS.items():
        if name == kind:
            data, group_sizes = _drop_group_sizes(data)
            cfg = _build(cls, data)
            _check_group_sizes(cfg, group_sizes)
            return cfg
    raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(_KINDS.values())}")


def _drop_group_sizes(data: Any) -> tuple[Any, dict[tuple[str, ...], Any]]:
    """Remove ``moe.group_size`` (configs written before it was dropped) from a copy of ``data``.

    Returns:
        The cleaned copy and, per path of the config that owns the encoder (``()`` for a
        classifier, ``("image",)`` / ``("text",)`` in a two-tower), the group size it held.
    """
    found: dict[tuple[str, ...], Any] = {}
    data = copy.deepcopy(data)

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        moe = node.get("moe") if path[-1:] == ("encoder",) else None
        if isinstance(moe, dict) and "group_size" in moe:
            found[path[:-1]] = moe.pop("group_size")
        for key, value in node.items():
            walk(value, (*path, key))

    walk(data, ())
    return data, found


def _check_group_sizes(cfg: ModelConfig, group_sizes: dict[tuple[str, ...], Any]) -> None:
    """The rule for an old ``group_size``: accepted and dropped when it is null or one sequence.

    That is what every converter and variant wrote (vmoe's Soft MoE configs use the tokens of one
    image). Any other value means vmoe routed groups that straddle sequences, which this port does
    not reproduce, so such a config is refused rather than served with different routing.
    """
    for path, size in group_sizes.items():
        owner: Any = cfg
        for name in path:
            owner = getattr(owner, name)
        seq = owner.num_tokens if isinstance(owner, ViTConfig) else getattr(owner, "max_len", None)
        if size is not None and size != seq:
            where = ".".join((*path, "encoder", "moe", "group_size"))
            raise ValueError(
                f"{where} = {size} differs from the sequence length {seq}: vmoe would route groups that "
                "straddle sequences; this port routes one sequence per group"
            )


# ---------------------------------------------------------------- the size table

# name: (hidden D, layers, mlp M, heads H), vmoe get_vit_config.
_WIDTHS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "H": (1280, 32, 5120, 16),
}


# Capacity rounding of the sparse routers (vmoe capacity_ceil_or_round, capacity_multiple_of):
# tokens choice keeps vmoe's compute_capacity defaults, which every vmoe_paper config leaves as they
# are; experts choice rounds to a multiple of 1, as vmoe's only experts-choice config
# (projects/soft_moe/configs/common.py) sets (ceil to a multiple of 4 can ask a group for more
# tokens than it has). Also softmoe_models.convert.sparse.
SPARSE_CAPACITY_ROUNDING: dict[str, tuple[CapacityRounding, int]] = {
    "tokens-choice": ("ceil", 4),
    "experts-choice": ("round", 1),
}


@dataclass(frozen=True)
class Variant:
    """One row of the size table."""

    name: str
    width: str  # Ti | S | B | L | H
    patch_size: int
    num_experts: int | None = None  # None: dense ViT
    moe_last_n: int = 0  # MoE in the last n blocks
    paper_params: str | None = None  # Table 1 of the paper (29,593-class JFT head)
    notes: str = field(default="", compare=False)
    router: Router = "soft"  # the MoE blocks' router (ROUTERS); sparse: vmoe's, evaluated as vmoe does
    experts_per_token: int | None = None  # K, tokens-choice only
    capacity_factor: float = 4.0  # sparse only: vmoe_paper's evaluation capacity factor

    def config(self, num_classes: int | None = 1000, image_size: int = 224) -> ViTConfig:
        d, layers, m, h = _WIDTHS[self.width]
        moe = None
        if self.num_experts:
            routing: dict[str, Any] = {"slots_per_expert": 1}
            if self.router != "soft":
                rounding, multiple_of = SPARSE_CAPACITY_ROUNDING[self.router]
                routing = dict(router=self.router, experts_per_token=self.experts_per_token,
                               capacity_factor=self.capacity_factor, capacity_rounding=rounding,
                               capacity_multiple_of=multiple_of)
            moe = MoEConfig(
                layers=tuple(range(layers))[-self.moe_last_n :],
                num_experts=self.num_experts,
                **routing,
            )
        enc = EncoderConfig(d, layers, h, m, qk_norm=True, moe=moe)
        return ViTConfig(enc, image_size=image_size, patch_size=self.patch_size, num_classes=num_classes)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("vit-s16", "S", 16, paper_params="33M"),
        Variant("vit-b16", "B", 16, paper_params="108M"),
        Variant("vit-l16", "L", 16, paper_params="333M"),
        Variant("vit-h14", "H", 14, paper_params="669M"),
        Variant("soft-s16-e128", "S", 16, 128, 6, paper_params="933M"),
        Variant("soft-s14-e256", "S", 14, 256, 6, paper_params="1.8B"),
        Variant("soft-b16-e128", "B", 16, 128, 6, paper_params="3.7B"),
        Variant("soft-l16-e128", "L", 16, 128, 12, paper_params="13.1B"),
        Variant("soft-h14-e256", "H", 14, 256, 16),
        # The sparse baselines the paper compares Soft MoE S/16 with (Tokens Choice, Experts
        # Choice) at its size: the same backbone, 128 experts in the same last 6 blocks, a (d, E)
        # router where Soft MoE holds its slots. Capacity factor 4.0, vmoe_paper's
        # evaluation value (the reference docs here do not state the paper's); a one-image
        # routing group of 196 tokens gives C = 8 (K=1), 16 (K=2), 6 (experts choice).
        Variant("tc-s16-e128-k1", "S", 16, 128, 6, router="tokens-choice", experts_per_token=1),
        Variant("tc-s16-e128-k2", "S", 16, 128, 6, router="tokens-choice", experts_per_token=2),
        Variant("ec-s16-e128", "S", 16, 128, 6, router="experts-choice"),
    ]
}


def variant_config(name: str, num_classes: int | None = 1000, image_size: int = 224) -> ViTConfig:
    """The config of a named variant, e.g. ``soft-b16-e128``."""
    try:
        variant = VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None
    return variant.config(num_classes=num_classes, image_size=image_size)
