"""The baselines `logitstore train`'s step is measured against (benchmarks/step.py on the CPU, the train
section of benchmarks/gpu.py on a GPU), on the same batches of the same store:

  PlainLoop         the loop a user would write in ten lines: `LlamaForCausalLM` of the student's
                    dimensions, SDPA causal attention over each row as a whole, bf16 autocast on CUDA,
                    `AdamW(fused=True)`, the full [B, L, V] logits, and the forward KL on the teacher's
                    stored entries gathered from the student's log-softmax (optionally under torch.compile)
  fused_linear_kd   the head and loss as Liger-kernel's fused linear cross-entropy computes them: chunks
                    of positions, the gradient of the logits written in the forward from its closed form
                    (softmax times the entries' weight, minus the entries), two matmuls for the gradients
                    of the hidden states and the weight; torch ops here, a Triton kernel in Liger. What a
                    chunk costs beyond its matmuls when nothing but the memory asks for chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from logitstore.trainer.model import BUILTIN_STUDENTS


class PlainLoop:
    """One optimizer step per batch (`step`), its loss left on the device."""

    def __init__(self, student: str, *, vocab_size: int, device: torch.device, compile: bool = False, seed: int = 0):
        config = LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True, **BUILTIN_STUDENTS[student])
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        with torch.device(device):
            self.model = LlamaForCausalLM(config)
        self.device, self.vocab_size = device, vocab_size
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        self.forward = torch.compile(self.model) if compile else self.model

    def step(self, batch) -> torch.Tensor:
        to = lambda t: t.to(self.device, non_blocking=True)
        targets = batch.targets
        entry_lp = to(targets.entry_logprobs)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.forward(input_ids=to(batch.input_ids)).logits
        log_q = F.log_softmax(logits.float(), dim=-1).view(-1, self.vocab_size)
        gathered = log_q[to(batch.positions)[to(targets.entry_pos)], to(targets.entry_ids)]
        loss = (entry_lp.exp() * (entry_lp - gathered)).sum() / len(batch.positions)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def fused_linear_kd(hidden, weight, entry_pos, entry_ids, entry_weight, entry_logprobs, *, chunk: int):
    """sum_i w_i (lp_i - log q_i) / P for the logits hidden @ weight.T, with its gradients, Liger's way."""
    return _FusedLinearKD.apply(hidden, weight, entry_pos, entry_ids, entry_weight, entry_logprobs, chunk)


class _FusedLinearKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, entry_pos, entry_ids, entry_weight, entry_logprobs, chunk):
        P = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        total = torch.zeros((), device=hidden.device)
        starts = torch.arange(0, P + chunk, chunk, device=hidden.device).clamp_max(P)
        cuts = torch.searchsorted(
            entry_pos, starts
        ).tolist()  # Liger's own cuts need none: its entries are one per position
        for c, a in enumerate(range(0, P, chunk)):
            b = min(a + chunk, P)
            e0, e1 = cuts[c], cuts[c + 1]
            pos, ids, w = entry_pos[e0:e1] - a, entry_ids[e0:e1], entry_weight[e0:e1]
            h = hidden[a:b]
            logits = (h @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (w * (entry_logprobs[e0:e1] - logits[pos, ids] + lse[pos])).sum()
            # d/dz: W_p softmax(z_p) - sum of w_i at the entries' ids, then / P
            per_position = torch.zeros(b - a, device=hidden.device).index_add_(0, pos, w)
            grad = (logits - lse[:, None]).exp_().mul_(per_position[:, None])
            grad.index_put_((pos, ids), -w, accumulate=True)
            grad = grad.div_(P).to(weight.dtype)
            torch.mm(grad, weight, out=grad_hidden[a:b])
            grad_weight.addmm_(grad.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total / P

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_output, grad_weight * grad_output, None, None, None, None, None
