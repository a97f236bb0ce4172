"""A real CUDA out-of-memory error under ``oom_backoff``: backed off, and the optimizer step kept.

``tests/test_adaptive_backoff.py`` proves the back-off with raised ``torch.OutOfMemoryError`` on CPU; here
the process may use a sliver of the GPU (``torch.cuda.set_per_process_memory_fraction``), the first
micro-batch does not fit in it, and the Trainer backs off and finishes its steps.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from cuda_tier import needs_cuda  # noqa: E402

from smart_batching.fallbacks import recorded_fallbacks  # noqa: E402

pytestmark = pytest.mark.cuda

CAP_BYTES = 1.5 * 2**30  # the cap, whatever the device (an H100's 80 GiB or an H200's 141 GiB)


def test_real_cuda_out_of_memory_backs_off_and_keeps_the_step(device, tmp_path):
    needs_cuda(device, "running out of CUDA memory")
    datasets = pytest.importorskip("datasets", reason="the Trainer's dataset is a datasets.Dataset")
    from smart_batching.hf import SmartBatchingTrainer

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 32000, size=int(n)).tolist() for n in rng.integers(200, 400, size=64)]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total))
    try:
        trainer = SmartBatchingTrainer(
            model=model,
            args=transformers.TrainingArguments(
                output_dir=str(tmp_path), report_to=[], max_steps=2, save_strategy="no", disable_tqdm=True
            ),
            train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
            strategy="token_budget",
            strategy_options={"max_tokens": 16384},  # its full logits alone take 2 GiB
            target_logits_only=False,
            oom_backoff=True,
        )
        trainer.train()
        peak = torch.cuda.max_memory_allocated() / 2**20
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()
    state = trainer.smart_batching.backoff_state
    print(
        f"[cuda tier] oom_backoff: {state.num_backoffs} back-offs, peak {peak:.0f} MiB under a 1536 MiB cap"
    )
    assert state.num_backoffs >= 1, (
        "the 16384-token micro-batch fit under the cap: no out-of-memory error to back off"
    )
    assert recorded_fallbacks().get("trainer.oom_backoff", 0) >= 1, (
        f"back-off not recorded: {recorded_fallbacks()}"
    )
    assert trainer.state.global_step == 2, f"the run stopped at step {trainer.state.global_step} of 2"
    moved = max((p.detach().cpu() - before[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 0, "the optimizer steps after the back-off changed no weight"
