"""The demo model: the shape of its LLM (``demo_llm_config``), its three trained
parts together (``DemoModel``: the LLM, the vision tower and the audio tower), and
their training-time forward over a packed batch of examples, with the attention
backend it runs on (``PackedCausalAttention``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from demo.examples import Example
from encoders.audio import AudioEncoder, AudioInput
from encoders.presets import DEMO_VISION
from encoders.vision import VisionEncoder, VisionInput
from llm_core.model.config import AttentionSpec, ModelConfig
from llm_core.model.model import MiMoV2ForCausalLM

__all__ = ["DemoModel", "PackedCausalAttention", "demo_llm_config"]


def demo_llm_config(vocab_size: int, eos_id: int) -> ModelConfig:
    """MiMo-V2-Flash's layout in miniature: full and sliding (W=32, sinks) layers,
    a dense first MLP then MoE, three MTP layers (MiMo-V2-Flash's count). The dense
    MLPs (the first layer's and each MTP layer's) are 256 wide, which keeps the
    float32 checkpoint under 20 MiB with three MTP layers."""
    full = AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=64, v_head_dim=64, rope_theta=5_000_000.0,
                         partial_rotary_factor=0.5, sliding_window=None, has_sinks=False)
    sliding = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, rope_theta=10_000.0,
                            partial_rotary_factor=0.5, sliding_window=33, has_sinks=True)
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=DEMO_VISION.out_hidden_size,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=("full", "sliding", "sliding", "full"),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        full_attention=full,
        sliding_attention=sliding,
        moe_intermediate_size=192,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        num_mtp_layers=3,
        eos_token_ids=(eos_id,),
        pad_token_id=0,
    )


class DemoModel(nn.Module):
    """The three trained parts, and the training-time forward over a packed batch."""

    def __init__(self, llm: MiMoV2ForCausalLM, vision: VisionEncoder, audio: AudioEncoder) -> None:
        super().__init__()
        self.llm, self.vision, self.audio = llm, vision, audio

    def media_rows(self, examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder outputs of every media item, and the flat positions they go to."""
        rows: list[torch.Tensor] = []
        positions: list[int] = []
        offset = 0
        per_kind: dict[str, list[tuple[VisionInput | AudioInput, int]]] = defaultdict(list)
        for ex in examples:
            for kind, item, start in ex.media:
                per_kind[kind].append((item, offset + start))
            offset += len(ex.ids)
        for kind, entries in per_kind.items():
            encoder = self.vision if kind == "vision" else self.audio
            # A frozen encoder (fine-tuning) keeps no graph: nothing flows back into it.
            trains = any(p.requires_grad for p in encoder.parameters())
            with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
                outputs = encoder.forward_items([item for item, _ in entries])
            for (_, start), out in zip(entries, outputs):
                rows.append(out)
                positions.extend(range(start, start + out.shape[0]))
        return torch.cat(rows), torch.tensor(positions, dtype=torch.long)

    def forward(self, examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(final hidden states, input embeddings, flat token ids) of the packed batch."""
        ids = torch.tensor([t for ex in examples for t in ex.ids], dtype=torch.long)
        lengths = [len(ex.ids) for ex in examples]
        positions = torch.cat([torch.arange(n) for n in lengths])
        embeds = self.llm.model.embed_tokens(ids)
        rows, where = self.media_rows(examples)
        embeds = embeds.index_copy(0, where, rows.to(embeds.dtype))
        backend = PackedCausalAttention(lengths)
        hidden = self.llm.model(ids, positions, backend, inputs_embeds=embeds)
        return hidden, embeds, ids

    def mtp_hidden(self, hidden: torch.Tensor, embeds: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Every MTP layer's output at every position t, chained as the engine runs them
        (MiMo / DeepSeek-V3): layer j is fed the previous depth's output at t (depth 0:
        the main model's final normed hidden[t]) and the embedding of token t+j+1
        (zeros past the end), attends over its own outputs at positions <= t and
        predicts token t+j+2."""
        lengths = list(lengths)
        positions = torch.cat([torch.arange(n) for n in lengths])
        backend = PackedCausalAttention(lengths)
        per_sequence = embeds.split(lengths)
        outputs: list[torch.Tensor] = []
        prev = hidden
        for j, layer in enumerate(self.llm.model.mtp.layers):
            shift = j + 1
            nxt = torch.cat([torch.cat((e[shift:], e.new_zeros(min(shift, e.shape[0]), e.shape[1])))
                             for e in per_sequence])
            prev = layer(nxt, prev, positions, backend)
            outputs.append(prev)
        return outputs


class PackedCausalAttention:
    """Attention backend for training: each packed sequence attends causally (and
    within the window on sliding layers) to itself; nothing is cached.

    Tiny per-sequence kernels would dominate step time, so sequences of similar
    length are padded into a few [B, L] groups, a few batched matmuls each. Rows move
    between the packed and the padded layouts by one gather each way (``index_select``:
    its backward is a scatter-add, far cheaper than fancy indexing's).
    """

    def __init__(self, lengths: Sequence[int], group_size: int = 8) -> None:
        self.lengths = list(lengths)
        by_length = sorted(range(len(self.lengths)), key=self.lengths.__getitem__)
        starts = np.cumsum([0, *self.lengths[:-1]])
        self.groups: list[_PaddedGroup] = []
        slot_of_row = torch.empty(sum(self.lengths), dtype=torch.long)
        offset = 0
        for g in range(0, len(by_length), group_size):
            members = by_length[g : g + group_size]
            group = _PaddedGroup([self.lengths[i] for i in members], [int(starts[i]) for i in members])
            slot_of_row[group.rows] = offset + group.slots
            offset += group.valid.numel()
            self.groups.append(group)
        self.slot_of_row = slot_of_row  # packed row -> its slot in the groups' padded outputs

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec, sinks: torch.Tensor | None) -> torch.Tensor:
        out = torch.cat([g.attend(q, k, v, spec.sliding_window, sinks) for g in self.groups])
        return out.index_select(0, self.slot_of_row)


class _PaddedGroup:
    """Sequences padded to one [B, L] batch. A padding slot holds a copy of some real
    row; a padding query sees every key so its softmax stays finite, and its output
    is dropped; no real query sees a padding key."""

    def __init__(self, lengths: Sequence[int], starts: Sequence[int]) -> None:
        width = max(lengths)
        steps = torch.arange(width)
        self.valid = steps[None, :] < torch.tensor(lengths)[:, None]  # [B, L]
        # Packed row of every slot (padding: the sequence's first row), row-major.
        rows = torch.tensor(starts)[:, None] + torch.where(self.valid, steps[None, :], 0)
        self.gather = rows.reshape(-1)
        self.slots = torch.nonzero(self.valid.reshape(-1)).squeeze(1)  # slots of real rows
        self.rows = self.gather[self.slots]  # ... and their packed rows
        self.offsets = steps[:, None] - steps[None, :]  # q_pos - k_pos, [L, L]
        self._bias: dict[int | None, torch.Tensor] = {}

    def bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, 1, L, L]: 0 where a query sees a key, -inf where it does not."""
        if window not in self._bias:
            seen = self.offsets >= 0
            if window is not None:
                seen &= self.offsets < window
            seen = (seen[None] & self.valid[:, None, :]) | ~self.valid[:, :, None]
            self._bias[window] = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, float("-inf"))[:, None, None]
        return self._bias[window].to(dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               sinks: torch.Tensor | None) -> torch.Tensor:
        """Padded outputs [B * L, Hq, Dv] of the group's slots."""
        hq, d = q.shape[1:]
        hkv, dv = k.shape[1], v.shape[2]
        group = hq // hkv
        batch, width = self.valid.shape
        # [B, Hkv, G * L, D]: a kv head's query heads stacked along the rows, no broadcast.
        qg = (q.index_select(0, self.gather) * d**-0.5).view(batch, width, hkv, group, d)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(batch, hkv, group * width, d)
        kh = k.index_select(0, self.gather).view(batch, width, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        vh = v.index_select(0, self.gather).view(batch, width, hkv, dv).transpose(1, 2)
        scores = torch.matmul(qg, kh.transpose(-1, -2)).view(batch, hkv, group, width, width)
        scores = scores + self.bias(window, scores.dtype)
        if sinks is not None:
            # A sink logit joins the denominator only: one more key, with a zero value.
            sink_col = sinks.to(scores.dtype).view(1, hkv, group, 1, 1).expand(batch, hkv, group, width, 1)
            scores = torch.cat((scores, sink_col), dim=-1)
            vh = torch.cat((vh, vh.new_zeros(batch, hkv, 1, dv)), dim=2)
        probs = torch.softmax(scores, dim=-1).view(batch, hkv, group * width, -1)
        out = torch.matmul(probs, vh).view(batch, hkv, group, width, dv)  # [B, Hkv, G, L, Dv]
        return out.permute(0, 3, 1, 2, 4).reshape(batch * width, hq, dv)

