"""Presets for Google's public V-MoE checkpoints (``gs://vmoe_checkpoints/<name>``, vmoe README).

A preset says what the vmoe config a checkpoint was trained and evaluated with sets and the
parameters cannot show (router, K, batch priority, capacity factor at evaluation, where the class
names come from), and what the parameters must show (sizes, experts, MoE blocks, image size,
classes, representation layer), which is checked: a checkpoint that differs is refused in one line
naming every difference. Flags given with a preset: ``--router`` and ``--experts-per-token``
describe training and must agree with it; ``--capacity-factor``, ``--batch-priority`` and
``--dispatch-dtype`` are evaluation choices and override it (with a notice).

Sources. vmoe-sparse-reference.md cites the builder ``vmoe/configs/vmoe_paper/common.py`` and
``vmoe_s32_last2_ilsvrc2012_randaug_light1.py`` (eval capacity 4.0); the other values are read from
the config files next to them in google-research/vmoe (``vmoe/configs/vmoe_paper/*.py``,
``vmoe/configs/eee_paper/*.py``) and the checkpoint list of vmoe's README. Each row names its file.

Dispatch dtype is not part of a preset: every vmoe_paper config sets ``dispatcher.bfloat16: True``,
but conversion defaults to float32 dispatch (the more exact computation; ``--dispatch-dtype
bfloat16`` reproduces vmoe's rounding, reference section 7).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ViTConfig
from .errors import ConversionError
from .sparse import E3_REFUSAL, SparseOptions

# vmoe_paper widths, vmoe/configs/vmoe_paper/common.py get_vmoe_config:
# name -> (hidden D, layers, mlp M, heads). Not the ViT papers' S (384 wide, 12 layers): vmoe's S
# has 8 layers (disclaimer in vmoe_s32_last2_ilsvrc2012_randaug_light1.py).
VMOE_WIDTHS: dict[str, tuple[int, int, int, int]] = {
    "S": (512, 8, 2048, 8),
    "B": (768, 12, 3072, 12),
}

S32_LAST2 = (5, 7)  # common.py "Last 2": range(1, num_layers=8, 2)[-2:]
B16_EVERY2 = (1, 3, 5, 7, 9, 11)  # common.py "Every 2": range(2 - 1, num_layers=12, 2)


@dataclass(frozen=True)
class Preset:
    """One public V-MoE checkpoint: what its vmoe config sets."""

    name: str  # gs://vmoe_checkpoints/<name>
    width: str  # key of VMOE_WIDTHS
    patch_size: int
    image_size: int  # the input side its position embeddings are for
    num_classes: int
    representation_size: int | None  # pre_logits width (common.py: = hidden); None: no pre_logits
    num_experts: int  # E
    moe_layers: tuple[int, ...]
    experts_per_token: int  # K (num_selected_experts); every public V-MoE is tokens-choice
    batch_priority: bool  # dispatcher.batch_priority
    capacity_factor: float  # dispatcher.capacity_factor at evaluation
    labels: str  # the dataset whose class names the head predicts (--labels; none ship here)
    source: str  # the vmoe file the values come from
    ensemble_size: int = 1  # E³ members M (> 1: refused, see sparse.E3_REFUSAL)

    @property
    def options(self) -> SparseOptions:
        """The routing this preset sets (dispatch dtype left to the flag, see the module docstring)."""
        return SparseOptions(router="tokens-choice", experts_per_token=self.experts_per_token,
                             capacity_factor=self.capacity_factor, batch_priority=self.batch_priority)


_LIGHT1 = "vmoe/configs/vmoe_paper/vmoe_s32_last2_ilsvrc2012_randaug_light1.py"

PRESETS: dict[str, Preset] = {p.name: p for p in [
    # 'ViT-S/32, E=8, K=2, Last 2, 300 Epochs', image_size 224, NUM_CLASSES 1000, common.py's
    # representation_size = hidden_size and batch_priority False; evaluation overrides the training
    # capacity factor 1.05 with 4.0 (evaluate.model_overrides; vmoe-sparse-reference.md's sources).
    Preset("vmoe_s32_last2_ilsvrc2012_randaug_light1", "S", 32, 224, 1000, 512, 8, S32_LAST2, 2, False, 4.0,
           "ILSVRC2012", _LIGHT1),
    # No config released. vmoe README: "V-MoE S/32, 8 experts on the last two odd blocks, trained from
    # scratch on ILSVRC2012 with RandAugment for 1000 epochs"; K, representation and the evaluation
    # capacity factor as light1, the config of the same model at 300 epochs.
    Preset("vmoe_s32_last2_ilsvrc2012_randaug_medium", "S", 32, 224, 1000, 512, 8, S32_LAST2, 2, False, 4.0,
           "ILSVRC2012", f"vmoe README (no config released); the rest as {_LIGHT1}"),
    # The 384 px fine-tune of light1: IMAGE_SIZE 384, representation_size None, capacity_factor 1.5
    # (no evaluation override), the same description 'ViT-S/32, E=8, K=2, Last 2'.
    Preset("vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012", "S", 32, 384, 1000, None, 8, S32_LAST2, 2,
           False, 1.5, "ILSVRC2012",
           "vmoe/configs/vmoe_paper/vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012.py"),
    # Pre-training config of the B/16 (its fine-tune initialises from this checkpoint):
    # 'ViT-B/16, E=8, K=2, Every 2, 300 Epochs', image_size 224, NUM_CLASSES 21843,
    # representation_size None, capacity_factor 1.05 (no evaluation override).
    Preset("vmoe_b16_imagenet21k_randaug_strong", "B", 16, 224, 21843, None, 8, B16_EVERY2, 2, False, 1.05,
           "ImageNet-21k", "vmoe/configs/vmoe_paper/pretrain_imagenet21k.py"),
    # IMAGE_SIZE 384, NUM_CLASSES 1000, representation_size None, capacity_factor 1.5.
    Preset("vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012", "B", 16, 384, 1000, None, 8, B16_EVERY2, 2,
           False, 1.5, "ILSVRC2012",
           "vmoe/configs/vmoe_paper/vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012.py"),
    # E³ (refused): 'EEE-S/32, K=1, M=2, Last 2', hidden 512, 8 layers, layers (5, 7),
    # representation_size 512, capacity_factor 1.5; pre-trained at 224 px on ILSVRC2012 (the
    # fine-tune's "We pre-trained on 224px"), fine-tuned at 128 px on CIFAR-100's 100 classes.
    Preset("eee_s32_last2_ilsvrc2012", "S", 32, 224, 1000, 512, 8, S32_LAST2, 1, False, 1.5, "ILSVRC2012",
           "vmoe README; vmoe/configs/eee_paper/eee_s32_last2_ilsvrc2012_ft_cifar100.py", ensemble_size=2),
    Preset("eee_s32_last2_ilsvrc2012_ft_cifar100", "S", 32, 128, 100, 512, 8, S32_LAST2, 1, False, 1.5,
           "CIFAR-100", "vmoe/configs/eee_paper/eee_s32_last2_ilsvrc2012_ft_cifar100.py", ensemble_size=2),
]}


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ConversionError: unknown name, or an E³ checkpoint (not served).
    """
    preset = PRESETS.get(name)
    if preset is None:
        raise ConversionError(f"unknown --preset {name!r}; known: {', '.join(PRESETS)}")
    if preset.ensemble_size > 1:
        raise ConversionError(f"--preset {name}: {E3_REFUSAL}")
    return preset


def apply_preset(preset: Preset, given: SparseOptions) -> tuple[SparseOptions, list[str]]:
    """The routing of ``preset`` with the evaluation flags in ``given`` over it.

    Returns:
        The merged options and one notice per overridden value.

    Raises:
        ConversionError: ``--router`` or ``--experts-per-token`` contradict the preset.
    """
    base = preset.options
    for name, flag in (("router", "--router"), ("experts_per_token", "--experts-per-token")):
        value = getattr(given, name)
        if value is not None and value != getattr(base, name):
            raise ConversionError(
                f"{flag} {value} contradicts --preset {preset.name}, which was trained with {getattr(base, name)} "
                f"({preset.source})")
    notices = []
    if given.capacity_factor is not None and given.capacity_factor != base.capacity_factor:
        notices.append(f"--capacity-factor {given.capacity_factor} overrides preset {preset.name}'s "
                       f"{base.capacity_factor}")
    if given.batch_priority is not None and given.batch_priority != base.batch_priority:
        notices.append(f"--{'' if given.batch_priority else 'no-'}batch-priority overrides preset {preset.name}'s "
                       f"batch priority {'on' if base.batch_priority else 'off'}")
    return given.merged_over(base), notices


def check_preset(preset: Preset, cfg: ViTConfig) -> None:
    """Refuse a checkpoint whose parameters differ from what ``preset`` describes.

    Raises:
        ConversionError: one line naming every difference, as ``what preset vs checkpoint``.
    """
    d, layers, mlp, heads = VMOE_WIDTHS[preset.width]
    enc, moe = cfg.encoder, cfg.encoder.moe
    want = {
        "hidden size": (d, enc.hidden_size),
        "layers": (layers, enc.num_layers),
        "mlp dim": (mlp, enc.mlp_dim),
        "heads": (heads, enc.num_heads),
        "patch size": (preset.patch_size, cfg.patch_size),
        "image size": (preset.image_size, cfg.image_size),
        "classes": (preset.num_classes, cfg.num_classes),
        "classifier": ("token", cfg.classifier),
        "representation size": (preset.representation_size, cfg.representation_size),
        "MoE blocks": (list(preset.moe_layers), list(moe.layers) if moe else []),
        "experts": (preset.num_experts, moe.num_experts if moe else None),
        "expert mlp dim": (mlp, (moe.mlp_dim or enc.mlp_dim) if moe else None),
    }
    diffs = [f"{what} {a} vs {b}" for what, (a, b) in want.items() if a != b]
    if moe is not None and not moe.sparse:
        diffs.insert(0, "router tokens-choice vs Soft MoE (Moe/Router/mu)")
    if diffs:
        raise ConversionError(
            f"the checkpoint does not match --preset {preset.name} (preset vs checkpoint): {'; '.join(diffs)}")
