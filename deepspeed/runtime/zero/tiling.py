"""TiledLinear: one Linear split into out_splits x in_splits tiles, each its own nn.Linear.

Under ZeRO-3 every tile is its own module, so its own gather unit: a huge projection is gathered
one tile at a time instead of whole (what upstream's TiledLinear is for). Output row `r` is the
sum over `c` of tile[r][c](input[..., in_parts[c]:in_parts[c+1]]); the bias lives in the last
column's tiles, so it is added once. With `init_linear`, the tiles start as slices of that Linear.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..utils import partition_uniform


def _parts(features: int, splits: int, what: str) -> list[int]:
    if not 1 <= splits <= features:
        raise RuntimeError(f"TiledLinear: {what}_splits must be in [1, {what}_features={features}], got {splits}")
    return partition_uniform(num_items=features, num_parts=splits)


class TiledLinear(nn.Module):

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type = nn.Linear, init_linear: nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = _parts(in_features, in_splits, "in")
        self.out_parts = _parts(out_features, out_splits, "out")
        self.use_bias = bias
        self.linears = nn.ModuleList()
        for r in range(out_splits):
            rows = self.out_parts[r + 1] - self.out_parts[r]
            self.linears.append(nn.ModuleList(
                linear_cls(self.in_parts[c + 1] - self.in_parts[c], rows, bias=bias and c == in_splits - 1, **kwargs)
                for c in range(in_splits)))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def _split_input(self, input_: Any) -> list[torch.Tensor]:
        if self.in_splits == 1 or self.input_is_already_split:
            return list(input_) if self.input_is_already_split else [input_]
        return [input_[..., self.in_parts[c]:self.in_parts[c + 1]] for c in range(self.in_splits)]

    def forward(self, input_: Any) -> Any:
        inputs = self._split_input(input_)
        if len(inputs) != self.in_splits:
            raise RuntimeError(f"TiledLinear: got {len(inputs)} input parts for in_splits={self.in_splits}")
        outputs = []
        for row in self.linears:
            out = None
            for tile, x in zip(row, inputs):
                out = self._reduce_local_output(out, tile(x))
            outputs.append(out)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _reduce_local_output(self, current: Any, new: Any) -> Any:
        return new if current is None else current + new

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Take the weights (and bias) of `other`, a Linear of the full size, slice by slice."""
        if other.weight.shape != (self.out_parts[-1], self.in_parts[-1]):
            raise ValueError(f"TiledLinear.copy_params_from: weight of shape {tuple(other.weight.shape)}, expected "
                             f"{(self.out_parts[-1], self.in_parts[-1])}")
        for r, row in enumerate(self.linears):
            rows = slice(self.out_parts[r], self.out_parts[r + 1])
            for c, tile in enumerate(row):
                tile.weight.copy_(other.weight[rows, self.in_parts[c]:self.in_parts[c + 1]])
                if tile.bias is not None and getattr(other, "bias", None) is not None:
                    tile.bias.copy_(other.bias[rows])


class TiledLinearReturnBias(TiledLinear):
    """For Linear classes whose forward returns (output, bias), as Megatron-LM's do (the bias
    added later, fused with what follows): outputs are summed, the last column's bias kept."""

    def _reduce_local_output(self, current: Any, new: Any) -> Any:
        if current is None:
            return new
        (out, bias), (new_out, new_bias) = current, new
        return out + new_out, new_bias if new_bias is not None else bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensors = torch.cat([o for o, _ in outputs], dim=-1)
        biases = [b for _, b in outputs]
        return tensors, (torch.cat(biases, dim=-1) if all(b is not None for b in biases) else None)


__all__ = ["TiledLinear", "TiledLinearReturnBias"]
