"""How Engine translates pdd config into vLLM arguments (no engine is started)."""

from __future__ import annotations

import os

import pytest

from pdd.config import EngineConfig, ModelConfig, load_config
from pdd.engine.env import omp_env
from pdd.engine.types import KvConnectorSpec, SamplingSpec
from pdd.errors import ConfigError


@pytest.fixture(scope="module")
def engine_cls():
    from pdd.engine.engine import Engine

    return Engine


def test_connector_spec_becomes_kv_transfer_config(engine_cls, tmp_path) -> None:
    spec = KvConnectorSpec(role="kv_consumer", extra_config={"peer": "127.0.0.1:9"})
    engine = engine_cls(ModelConfig(), EngineConfig(kv_cache_space_gib=0.5), spec)
    args = engine._engine_args(tmp_path)
    kv = args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_connector_module_path, kv.kv_role) == (
        "PddConnector",
        "pdd.engine.connector",
        "kv_consumer",
    )
    assert kv.kv_connector_extra_config == {"peer": "127.0.0.1:9"}
    assert args.kv_cache_memory_bytes == 512 * 1024 * 1024
    assert args.skip_tokenizer_init is True
    assert (args.block_size, args.max_model_len, args.dtype) == (32, 4096, "float32")


def test_no_connector_by_default(engine_cls, tmp_path) -> None:
    args = engine_cls(ModelConfig(), EngineConfig())._engine_args(tmp_path)
    assert args.kv_transfer_config is None


def test_a_streaming_p_on_a_gpu_prefills_in_2048_token_steps(engine_cls, tmp_path, monkeypatch):
    # A P's chunk leaves only once its forward ran: on a GPU without a configured budget it
    # prefills in 2,048-token steps (vLLM's GPU default, 8,192 or more, left a prompt's first
    # 8K tokens unsent); a configured budget, every other engine, and CPUs keep theirs.
    import pdd.engine.engine as engine_module

    def budget(streams_kv: bool, **engine) -> int | None:
        e = engine_cls(ModelConfig(), EngineConfig(**engine), streams_kv=streams_kv)
        return e.step_tokens()

    monkeypatch.setattr(engine_module.current_platform, "is_cpu", lambda: True)
    assert budget(True) is None  # a CPU: vLLM's own default
    configured = EngineConfig(max_num_batched_tokens=512)
    args = engine_cls(ModelConfig(), configured, streams_kv=True)._engine_args(tmp_path)
    assert args.max_num_batched_tokens == 512
    monkeypatch.setattr(engine_module.current_platform, "is_cpu", lambda: False)
    assert budget(True) == 2048
    assert budget(True, max_num_batched_tokens=512) == 512
    assert budget(True, max_num_seqs=4096) == 4096  # vLLM needs a step to hold every sequence
    assert budget(False) is None


def test_only_a_p_with_stream_kv_streams() -> None:
    cfg = load_config("configs/local.yaml")
    streams = {w.id: cfg.streams_kv(w.id) for w in cfg.workers}
    assert streams == {"p": True, "rld": False, "md": False}
    off = load_config("configs/local.yaml", ["router.pdd.stream_kv=false"])
    assert not any(off.streams_kv(w.id) for w in off.workers)


def test_sampling_params_carry_kv_transfer_params_and_eos(engine_cls) -> None:
    from vllm.sampling_params import RequestOutputKind

    engine = engine_cls(ModelConfig(), EngineConfig())
    engine._eos_ids = (2,)
    params = engine._sampling_params(
        SamplingSpec(temperature=0, max_tokens=3, stop_token_ids=(30,)), {"remote": "x"}
    )
    assert params.extra_args == {"kv_transfer_params": {"remote": "x"}}
    assert params.output_kind == RequestOutputKind.DELTA
    assert params.detokenize is False
    assert sorted(params.stop_token_ids) == [2, 30]
    no_eos = engine._sampling_params(SamplingSpec(ignore_eos=True), None)
    assert no_eos.stop_token_ids == [] and no_eos.extra_args is None


def test_spawn_env_is_temporary(engine_cls, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    engine = engine_cls(ModelConfig(), EngineConfig(omp_threads_bind="1"))
    with engine._spawn_env():
        assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
        assert (os.environ["OMP_PLACES"], os.environ["OMP_NUM_THREADS"]) == ("{1}", "1")
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "OMP_PLACES" not in os.environ


def test_omp_env_parsing() -> None:
    assert omp_env("0,2-3", multiproc=False)["OMP_PLACES"] == "{0,2,3}"
    assert omp_env("auto", multiproc=False) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert omp_env("0-1", multiproc=True) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    with pytest.raises(ConfigError, match="bad CPU list"):
        omp_env("zero", multiproc=False)


def test_a_workers_engine_dtype_overrides_the_models(engine_cls, tmp_path) -> None:
    from pdd.worker.layout import block_bytes_of

    model = ModelConfig(dtype="float32")
    assert engine_cls(model, EngineConfig())._engine_args(tmp_path).dtype == "float32"
    args = engine_cls(model, EngineConfig(dtype="bfloat16"))._engine_args(tmp_path)
    assert args.dtype == "bfloat16"
    # the arena's slots follow the engine's dtype: 30 layers x 3 heads x 64 x 2 x 32 tokens
    assert block_bytes_of(model, 32, "bfloat16") * 2 == block_bytes_of(model, 32) == 1_474_560


def test_tensor_parallel_ranks_run_in_vllms_multiprocess_executor(
    engine_cls, tmp_path, monkeypatch
):
    one = engine_cls(ModelConfig(), EngineConfig())._engine_args(tmp_path)
    assert (one.tensor_parallel_size, one.distributed_executor_backend) == (1, None)
    config = EngineConfig(tensor_parallel_size=3, omp_threads_bind="0|1|1")
    engine = engine_cls(ModelConfig(), config)
    args = engine._engine_args(tmp_path)
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (3, "mp")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with engine._spawn_env():  # each rank binds its own entry: vLLM's CPU worker reads it
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1|1"
        assert "OMP_PLACES" not in os.environ


def test_a_workers_weight_quantization_and_kv_cache_dtype_reach_vllm(engine_cls, tmp_path):
    plain = engine_cls(ModelConfig(), EngineConfig())._engine_args(tmp_path)
    assert (plain.quantization, plain.kv_cache_dtype) == (None, "auto")
    config = EngineConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    args = engine_cls(ModelConfig(), config)._engine_args(tmp_path)
    assert (args.quantization, args.kv_cache_dtype) == ("fp8", "fp8_e4m3")
    assert config.kv_dtype("float32") == "fp8_e4m3"
    assert EngineConfig(dtype="bfloat16").kv_dtype("float32") == "bfloat16"


def test_async_scheduling_is_vllms_default_unless_the_config_says(engine_cls, tmp_path):
    assert engine_cls(ModelConfig(), EngineConfig())._engine_args(tmp_path).async_scheduling is None
    off = EngineConfig(async_scheduling=False)
    assert engine_cls(ModelConfig(), off)._engine_args(tmp_path).async_scheduling is False


def test_every_engine_registers_the_constraint_penalty_and_bad_words_processors(
    engine_cls, tmp_path
):
    from pdd.engine.bad_words import FQCN as BAD_WORDS
    from pdd.engine.constraint import FQCN
    from pdd.engine.penalties import FQCN as PENALTIES

    args = engine_cls(ModelConfig(), EngineConfig())._engine_args(tmp_path)
    assert args.logits_processors == [FQCN, PENALTIES, BAD_WORDS]


def test_prior_output_rides_in_extra_args_only_with_a_penalty(engine_cls) -> None:
    from pdd.engine.penalties import EXTRA_KEY

    engine = engine_cls(ModelConfig(), EngineConfig())
    pen = engine._sampling_params(SamplingSpec(frequency_penalty=0.5, prior_output_tokens=3), None)
    assert pen.extra_args == {EXTRA_KEY: 3}
    plain = engine._sampling_params(SamplingSpec(prior_output_tokens=3), None)
    assert not (plain.extra_args or {}).get(EXTRA_KEY)


def test_bad_words_ride_in_extra_args_with_the_earlier_tiers_count(engine_cls) -> None:
    from pdd.engine.bad_words import EXTRA_KEY

    engine = engine_cls(ModelConfig(), EngineConfig())
    spec = SamplingSpec(bad_words=((5, 6), (7,)), prior_output_tokens=2)
    words = engine._sampling_params(spec, None)
    assert words.extra_args == {EXTRA_KEY: {"words": [[5, 6], [7]], "prior": 2}}
    plain = engine._sampling_params(SamplingSpec(prior_output_tokens=2), None)
    assert not (plain.extra_args or {}).get(EXTRA_KEY)


def test_a_constraint_rides_in_extra_args_and_is_checked_first(engine_cls) -> None:
    from pdd.engine.types import ConstraintSpec
    from pdd.errors import InvalidRequestError

    engine = engine_cls(ModelConfig(), EngineConfig())
    spec = ConstraintSpec("regex", "[0-9]+", resume=(7, 8), param="guided_regex")
    params = engine._sampling_params(SamplingSpec(constraint=spec), {"remote": "x"})
    assert params.extra_args == {
        "kv_transfer_params": {"remote": "x"},
        "pdd_constraint": {"kind": "regex", "spec": "[0-9]+", "resume": [7, 8],
                           "param": "guided_regex"},
    }  # fmt: skip
    engine.validate([1, 2], SamplingSpec(constraint=spec))
    bad = ConstraintSpec("json_schema", '{"type": "nope"}')
    with pytest.raises(InvalidRequestError) as err:
        engine.validate([1, 2], SamplingSpec(constraint=bad))
    assert err.value.param == "response_format"
