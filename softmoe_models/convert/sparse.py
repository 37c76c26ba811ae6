"""What a sparse V-MoE checkpoint cannot show: its routing, given by flags or a preset.

A sparse V-MoE block holds ``Moe/Router/dense/kernel (D, E)`` (no bias) where a Soft MoE block
holds ``Moe/Router/mu (D, n, p)`` and ``scale``; the experts ``Moe/Mlp/Dense_{0,1}`` are stacked
expert-first in both (vmoe-sparse-reference.md section 9). The parameters show the experts (E),
their width and which blocks are MoE. They do not show how tokens were routed:

    router             tokens-choice (vmoe NoisyTopExpertsPerItemRouter) or experts-choice
                       (NoisyTopItemsPerExpertRouter): same parameters, different function
    experts_per_token  K, tokens-choice only (vmoe num_selected_experts)
    capacity_factor    cf at evaluation (vmoe_paper eval configs: 4.0)
    batch_priority     tokens-choice claims in descending top-1 gate order (vmoe: off)
    dispatch_dtype     float32, or bfloat16 as vmoe's Bfloat16Dispatcher

Capacity rounding is chosen by the router, with no flag: tokens-choice uses vmoe's
``compute_capacity`` defaults (ceil, then up to a multiple of 4), which every vmoe_paper config
leaves as they are; experts-choice uses round and multiple of 1, what vmoe's only experts-choice
config (``projects/soft_moe/configs/common.py``) sets and the golden ``vmoe_ec_e4`` was made with.
With ceil and a multiple of 4 an experts-choice layer asks for more tokens than a one-image group
holds (17 tokens, E=4, cf 4.0: C=20) and vmoe's top_k fails (reference sections 6 and 14).

E³ (vmoe ``VisionTransformerMoeEnsemble``, ``vmoe/nn/vit_moe_ensemble.py``) is refused: it repeats
every image M times before the first MoE layer, routes copy m only among its own E/M experts (an
ensemble router whose kernel is ``(D, M, E/M)``) and averages the M members' predictions. The
model classes here implement one copy of each image routed over all E experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import DISPATCH_DTYPES, CapacityRounding, DispatchDtype, MoEConfig, Router
from .errors import ConversionError

SPARSE_ROUTERS: tuple[str, ...] = ("tokens-choice", "experts-choice")

# router -> (capacity_rounding, capacity_multiple_of): see the module docstring.
CAPACITY_ROUNDING: dict[str, tuple[CapacityRounding, int]] = {
    "tokens-choice": ("ceil", 4),
    "experts-choice": ("round", 1),
}

DEFAULT_CAPACITY_FACTOR = 4.0  # vmoe_paper's evaluation value (evaluate.model_overrides)
DEFAULT_DISPATCH_DTYPE: DispatchDtype = "float32"

# field -> the `softmoe convert` flag that sets it (error messages name flags).
FLAGS: dict[str, str] = {
    "router": "--router",
    "experts_per_token": "--experts-per-token",
    "capacity_factor": "--capacity-factor",
    "batch_priority": "--batch-priority",
    "dispatch_dtype": "--dispatch-dtype",
}

E3_REFUSAL = (
    "E³ (vmoe VisionTransformerMoeEnsemble, vmoe/nn/vit_moe_ensemble.py) is not served: it repeats each image "
    "M times before the first MoE layer, routes copy m only among its own E/M experts and averages the M "
    "members' predictions; the model classes here route one copy of each image over all E experts"
)


@dataclass(frozen=True)
class SparseOptions:
    """The routing of a sparse V-MoE as given to the converter; None = not given."""

    router: Router | None = None  # tokens-choice | experts-choice
    experts_per_token: int | None = None  # K (tokens-choice)
    capacity_factor: float | None = None  # cf; None = DEFAULT_CAPACITY_FACTOR
    batch_priority: bool | None = None  # None = off
    dispatch_dtype: DispatchDtype | None = None  # None = DEFAULT_DISPATCH_DTYPE

    def given(self) -> list[str]:
        """The flags of the fields that are set, e.g. ``['--router', '--capacity-factor']``."""
        return [flag for name, flag in FLAGS.items() if getattr(self, name) is not None]

    def check(self) -> None:
        """Refuse values that are wrong whatever the checkpoint holds.

        Raises:
            ConversionError: one line naming the flag.
        """
        if self.router is not None and self.router not in SPARSE_ROUTERS:
            raise ConversionError(f"--router {self.router!r} is not one of {{{','.join(SPARSE_ROUTERS)}}}")
        if self.dispatch_dtype is not None and self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ConversionError(
                f"--dispatch-dtype {self.dispatch_dtype!r} is not one of {{{','.join(DISPATCH_DTYPES)}}}")
        if self.experts_per_token is not None and self.experts_per_token < 1:
            raise ConversionError(f"--experts-per-token must be >= 1, got {self.experts_per_token}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConversionError(f"--capacity-factor must be > 0, got {self.capacity_factor}")
        if self.router == "experts-choice":
            for name in ("experts_per_token", "batch_priority"):
                if getattr(self, name):
                    raise ConversionError(
                        f"{FLAGS[name]} is for --router tokens-choice; experts-choice has every expert pick "
                        "its tokens (no per-token choices to count or order)")

    def merged_over(self, base: SparseOptions) -> SparseOptions:
        """These options where they are set, ``base``'s elsewhere (flags over a preset)."""
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return SparseOptions(**{k: getattr(base, k) if v is None else v for k, v in mine.items()})


def sparse_moe_config(options: SparseOptions | None, *, layers: tuple[int, ...], num_experts: int,
                      mlp_dim: int | None, where: str) -> MoEConfig:
    """The MoE config of sparse blocks ``layers`` with ``num_experts`` experts, routed as ``options``.

    Args:
        options: the routing given (flags and/or a preset); None when nothing was given.
        layers: the MoE block indices the parameters show.
        num_experts: E, from ``Moe/Router/dense/kernel (D, E)``.
        mlp_dim: the experts' width when it differs from the encoder's, else None.
        where: the encoder's parameter group, for messages.

    Raises:
        ConversionError: the router (or K for tokens-choice) is not given, or the values do not fit
            the checkpoint (K > E, ...).
    """
    options = options or SparseOptions()
    options.check()
    kernel = f"{where}/encoderblock_{layers[0]}/Moe/Router/dense/kernel"
    if options.router is None:
        raise ConversionError(
            f"the checkpoint is a sparse V-MoE ({kernel}, {num_experts} experts in blocks {list(layers)}), whose "
            "parameters do not show the router: pass --router tokens-choice (vmoe NoisyTopExpertsPerItemRouter, "
            "the V-MoE paper's) or --router experts-choice (NoisyTopItemsPerExpertRouter), or a --preset")
    k = options.experts_per_token
    if options.router == "tokens-choice":
        if k is None:
            raise ConversionError(
                f"--router tokens-choice needs --experts-per-token K (vmoe num_selected_experts; the V-MoE paper's "
                f"checkpoints use 2): the parameters of {kernel} do not show it")
        if k > num_experts:
            raise ConversionError(f"--experts-per-token {k} exceeds the checkpoint's {num_experts} experts ({kernel})")
    rounding, multiple_of = CAPACITY_ROUNDING[options.router]
    try:
        return MoEConfig(
            layers=layers,
            num_experts=num_experts,
            mlp_dim=mlp_dim,
            router=options.router,
            experts_per_token=k if options.router == "tokens-choice" else None,
            capacity_factor=float(options.capacity_factor if options.capacity_factor is not None
                                  else DEFAULT_CAPACITY_FACTOR),
            capacity_rounding=rounding,
            capacity_multiple_of=multiple_of,
            batch_priority=bool(options.batch_priority),
            dispatch_dtype=options.dispatch_dtype or DEFAULT_DISPATCH_DTYPE,
        )
    except ValueError as e:
        raise ConversionError(str(e)) from None
