"""The exportable graphs of a package: plain modules with named tensor inputs and outputs.

    classifier:  pixel_values (N, 3, H, W) float32        -> logits (N, K), pre_logits (N, D)
                 (feature-only image models: -> pre_logits)
    two-tower:   pixel_values (N, 3, H, W) float32        -> image_embeds (N, D), L2-normalised
                 input_ids (M, L) int64                   -> text_embeds (M, D), L2-normalised
    encoder:     inputs_embeds (N, seq_len, embed_dim)    -> hidden (N, hidden_size)
    routing:     pixel_values                             -> the classifier's (or image tower's) outputs,
                 then dispatch_weights, combine_weights (N, L, m, s), dispatch_entropy, combine_entropy
                 (N, L), expert_share (N, L, n): every Soft MoE layer of the image model
                 (softmoe_models.routing); a separate graph, so the plain ones stay as they are.
                 Sparse V-MoE models: combine_weights (N, L, m, E), dropped (N, L, m), expert_load
                 (N, L, E), then the same statistics and dropped_choices (N, L)
                 (softmoe_models.sparse_routing)

Inputs and outputs stay float32 whatever the compute precision; casts happen inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from softmoe_models import routing, sparse_routing
from softmoe_models.config import SeqEncoderConfig, TwoTowerConfig, ViTConfig
from softmoe_models.soft_moe import capture_routing, soft_moe_layers
from softmoe_models.sparse_moe import sparse_moe_layers
from softmoe_models.two_tower import normalize_embeddings


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str, ...]  # str = symbolic (batch)
    dtype: torch.dtype


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def _in(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if x.is_floating_point() else x


class ClassifierGraph(_Cast):
    """``logits`` and the pooled representation ``pre_logits`` (what /v1/embed returns)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        features = self.model.forward_features(self._in(pixel_values))
        if self.model.head is None:
            return features.float()
        return self.model.head(features).float(), features.float()


class ImageTowerGraph(_Cast):
    def __init__(self, tower: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.tower = tower

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return normalize_embeddings(self.tower(self._in(pixel_values)).float())


class TextTowerGraph(_Cast):
    def __init__(self, tower: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.tower = tower

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return normalize_embeddings(self.tower(input_ids).float())


class TwoTowerGraph(nn.Module):
    """Both towers in one graph, independent batch sizes."""

    def __init__(self, image: ImageTowerGraph, text: TextTowerGraph) -> None:
        super().__init__()
        self.image, self.text = image, text

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image(pixel_values), self.text(input_ids)


class EncoderGraph(_Cast):
    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.model = model

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.model(self._in(inputs_embeds)).float()


class RoutingGraph(nn.Module):
    """The plain image graph's outputs plus the routing of every Soft MoE layer it runs through:
    the same forward pass, its dispatch and combine weights kept (``capture_routing``), and the
    per-image statistics as a few reductions on them."""

    def __init__(self, plain: nn.Module, image_model: nn.Module) -> None:
        super().__init__()
        self.plain = plain
        self._layers = list(soft_moe_layers(image_model))  # a plain list: already submodules of `plain`

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with capture_routing(self._layers):
            out = self.plain(pixel_values)
            dispatch, combine = routing.stack_routing(self._layers)  # (N, L, m, s)
        outs = out if isinstance(out, tuple) else (out,)
        stats = routing.routing_statistics(dispatch, combine, self._layers[0].num_experts)
        return (*outs, dispatch, combine, *stats)


class SparseRoutingGraph(nn.Module):
    """RoutingGraph for sparse V-MoE layers: the plain outputs, each layer's combine weights,
    dropped choices and expert loads, and their statistics."""

    def __init__(self, plain: nn.Module, image_model: nn.Module) -> None:
        super().__init__()
        self.plain = plain
        self._layers = list(sparse_moe_layers(image_model))

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with capture_routing(self._layers):
            out = self.plain(pixel_values)
            combine, dropped, load = sparse_routing.stack_routing(self._layers)
        outs = out if isinstance(out, tuple) else (out,)
        stats = sparse_routing.routing_statistics(combine, dropped)
        return (*outs, combine, dropped.float(), load.float(), *stats)


def _routing_graph(plain: nn.Module, image_model: nn.Module, layout) -> nn.Module:
    return RoutingGraph(plain, image_model) if isinstance(layout, routing.Layout) else SparseRoutingGraph(plain, image_model)


@dataclass
class Graph:
    """One exportable module and its I/O contract."""

    role: str  # classifier | image | text | two-tower | encoder | routing
    module: nn.Module
    inputs: list[TensorSpec]
    outputs: list[str]


def _pixels(cfg: ViTConfig) -> TensorSpec:
    return TensorSpec("pixel_values", ("batch", cfg.in_channels, cfg.image_size, cfg.image_size), torch.float32)


def graphs_for(model: nn.Module, dtype: torch.dtype) -> dict[str, Graph]:
    """The graphs to export for a loaded package model, keyed by role."""
    cfg = model.cfg
    if isinstance(cfg, ViTConfig):
        outs = ["logits", "pre_logits"] if cfg.num_classes else ["pre_logits"]
        plain = ClassifierGraph(model, dtype)
        graphs = {"classifier": Graph("classifier", plain, [_pixels(cfg)], outs)}
        if (layout := routing.any_layout(cfg)) is not None:
            graphs["routing"] = Graph("routing", _routing_graph(plain, model, layout), [_pixels(cfg)],
                                      [*outs, *routing.outputs_of(layout)])
        return graphs
    if isinstance(cfg, TwoTowerConfig):
        image = ImageTowerGraph(model.image, dtype)
        text = TextTowerGraph(model.text, dtype)
        ids = TensorSpec("input_ids", ("text_batch", cfg.text.max_len), torch.int64)
        pix = _pixels(cfg.image)
        graphs = {
            "two-tower": Graph("two-tower", TwoTowerGraph(image, text), [pix, ids], ["image_embeds", "text_embeds"]),
            "image": Graph("image", image, [pix], ["image_embeds"]),
            "text": Graph("text", text, [TensorSpec("input_ids", ("batch", cfg.text.max_len), torch.int64)], ["text_embeds"]),
        }
        if (layout := routing.any_layout(cfg)) is not None:
            graphs["routing"] = Graph("routing", _routing_graph(image, model.image, layout), [pix],
                                      ["image_embeds", *routing.outputs_of(layout)])
        return graphs
    if isinstance(cfg, SeqEncoderConfig):
        spec = TensorSpec("inputs_embeds", ("batch", cfg.seq_len, cfg.embed_dim), torch.float32)
        return {"encoder": Graph("encoder", EncoderGraph(model, dtype), [spec], ["hidden"])}
    raise TypeError(f"unsupported model config {type(cfg).__name__}")


def example_inputs(graph: Graph, batch: int, seed: int = 0, vocab: int = 2, value_range=(-1.0, 1.0)) -> dict[str, torch.Tensor]:
    """Deterministic inputs of the given batch size (every symbolic dim = ``batch``)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in graph.inputs:
        shape = tuple(batch if isinstance(d, str) else d for d in spec.shape)
        if spec.dtype.is_floating_point:
            lo, hi = value_range
            out[spec.name] = torch.rand(shape, generator=gen) * (hi - lo) + lo
        else:
            out[spec.name] = torch.randint(0, vocab, shape, generator=gen, dtype=spec.dtype)
    return out
