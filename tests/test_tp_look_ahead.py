"""Steps scheduled ahead under tensor parallelism (``LLMEngine.look_ahead``), on the CPU
over gloo: rank 0 schedules and enqueues a step while the one before it runs, and each
enqueued step goes to the follower as it is launched (``ModelRunner.launch_step``). On
CUDA this is on by default with the mixed-step graphs (``test_tensor_parallel``'s cuda
tests); on CPU the engine turns it off, so this test turns it on, as ``test_look_ahead``
does for one rank, and checks that TP=2 still gives TP=1's tokens and cache hits on the
workload that takes every engine path (``test_tensor_parallel.paths_workload``) except
speculation, which never looks ahead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_tensor_parallel import ENGINE, run_paths, tiny_config, tp_engine, write_checkpoint, write_tokenizer

#: Prefill chunks of at most 32 tokens beside decodes, no speculation.
LOOK_AHEAD_ENGINE = {**ENGINE, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_checkpoint(tmp_path_factory.mktemp("tp_ahead") / "tiny", tiny_config())
    write_tokenizer(folder)
    return folder


def test_tp2_looking_ahead_gives_tp1s_tokens(folder: Path) -> None:
    from worker.llm import LLM

    outs1, _ = run_paths(LLM(model=str(folder), device="cpu", **LOOK_AHEAD_ENGINE))
    with tp_engine(folder, "cpu", engine_settings=LOOK_AHEAD_ENGINE) as (llm2, _, deaths):
        engine = llm2.engine
        assert engine.proposer is None and not engine.look_ahead  # off on CPU by default
        engine.look_ahead = True
        outs2, steps = run_paths(llm2)
        assert not deaths
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]
    assert [o.num_cached_tokens for o in outs2] == [o.num_cached_tokens for o in outs1]
    assert engine.num_steps_ahead > 0 and engine.num_async_steps > 0
    assert any(prefill and decode for prefill, decode in steps)


def test_ranks_given_other_settings_are_refused_at_start(folder: Path) -> None:
    """A follower started with other engine settings than rank 0's (here another token
    budget) would capture other graphs and wait forever in rank 0's collectives: both
    ranks refuse at start instead, rank 0 with a ValueError that says why."""
    from shared.model_source import resolve_model
    from shared.settings import EngineSettings, ModelSettings
    from worker.llm import LLM
    from worker.parallel.follower import start_for_engine

    model = ModelSettings(model=str(folder), dtype="float32", max_model_len=256, device="cpu")
    settings = {k: v for k, v in LOOK_AHEAD_ENGINE.items() if k not in ("dtype", "max_model_len")}
    group = start_for_engine(resolve_model(str(folder)), model,
                             EngineSettings(tensor_parallel_size=2, **{**settings, "max_num_batched_tokens": 64}),
                             on_death=lambda: None)
    try:
        with pytest.raises(ValueError, match="other engine settings"):
            LLM(model=str(folder), tensor_parallel_size=2, device="cpu", **LOOK_AHEAD_ENGINE)
    finally:
        group.close()
    follower = group.followers[0]
    follower.join(10)
    assert not follower.is_alive()  # it refused too (or the close ended it first)
