"""Ranks > 0 of a tensor-parallel group: build this rank's shard and its model runner,
then run whatever model call rank 0 announces (``step_sync.py``) until STOP.

``start_for_engine`` is rank 0's side: it checks the model splits, then starts the group
(``group.start``) with this module's ``follower_main`` as the other ranks.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from typing import Any, NoReturn

import torch

from shared.model_source import ModelSource, max_model_len
from shared.settings import EngineSettings, ModelSettings
from worker.parallel import group as tp_group
from worker.parallel.layers import shard_spec
from worker.parallel.step_sync import OP_DECODE, OP_FORWARD, OP_LOGITS, OP_MIXED, OP_STOP, StepSync

log = logging.getLogger(__name__)

def start_for_engine(source: ModelSource, model: ModelSettings, engine: EngineSettings,
                     **kwargs: Any) -> tp_group.TPGroup:
    """Rank 0: start a group of ``engine.tensor_parallel_size`` ranks for ``source``
    before the engine is built (``kwargs`` go to ``group.start``).

    Raises:
        ValueError: the model does not split (``layers.shard_spec``; checked here, before
            any process starts), nor its FP8 scales (``fp8_shards.check_fp8_shards``), a
            checkpoint quantization that cannot load, a draft-model proposer, or more
            ranks than GPUs.
    """
    from worker.engine.engine import resolve_device
    from worker.models.config import ModelConfig
    from worker.models.fp8 import resolve_quantization
    from worker.models.loader import fp8_layout
    from worker.parallel.fp8_shards import check_fp8_shards

    cfg = ModelConfig.from_hf(source.config)
    shard_spec(cfg, 0, engine.tensor_parallel_size)
    quantization, prequantized = resolve_quantization(model.quantization, source.config)
    if quantization == "fp8":  # its scales must split with the weights (worker/parallel/fp8_shards.py)
        check_fp8_shards(cfg, engine.tensor_parallel_size, fp8_layout(prequantized, source.dummy))
    if engine.speculative_method == "draft":  # the draft model would be built unsharded on rank 0 only
        raise ValueError("--speculative-method draft is not supported with --tensor-parallel-size (ngram is)")
    return tp_group.start(engine.tensor_parallel_size, resolve_device(model.device), follower_main,
                          (source, model, engine), **kwargs)


def follower_main(rank: int, world_size: int, port: int, device: torch.device, source: ModelSource,
                  model_settings: ModelSettings, engine_settings: EngineSettings) -> None:
    """Process entry of rank ``rank``: join, build the shard and the runner as rank 0
    does (``LLMEngine.__init__``), then ``serve`` until STOP, and exit at once with
    status 0 (``group.exit_process``: no collective teardown, which would wait for rank
    0's; docs/architecture.md, "Tensor parallelism"), or 1 when a call fails. Exits
    with rank 0 (``EXIT_RANK_DIED``) when rank 0 dies; ignores SIGINT and SIGTERM."""
    tp_group.ignore_stop_signals()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")
    parent = multiprocessing.parent_process()
    if parent is not None:  # rank 0 gone (even SIGKILLed): so are we
        tp_group.watch(threading.Event(), [parent.sentinel], tp_group.exit_now)
    from worker.engine.engine import cpu_threads, num_kv_blocks, resolve_dtype
    from worker.engine.kv_calibration import kv_calibration_ids
    from worker.engine.model_runner import ModelRunner
    from worker.models.config import ModelConfig
    from worker.models.fp8 import resolve_quantization
    from worker.models.loader import build_model

    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(engine_settings))
    group = tp_group.join(rank, world_size, port, device)
    dtype = resolve_dtype(model_settings.dtype, group.device)
    cfg = ModelConfig.from_hf(source.config)
    max_len = max_model_len(source.config, model_settings.max_model_len)
    quantization, prequantized = resolve_quantization(model_settings.quantization, source.config)
    model = build_model(cfg, source.path, source.dummy, dtype, group.device, max_len, model_settings.seed,
                        quantization, prequantized)
    # Sized from this rank's shard; ModelRunner takes the group's smallest count.
    num_blocks = num_kv_blocks(model.shard_config, engine_settings, dtype, group.device)
    runner = ModelRunner(model, engine_settings, num_blocks, max_len, dtype, group.device, model_settings.seed,
                         kv_calibration_ids(source, engine_settings, cfg.vocab_size, max_len))  # as rank 0's
    sync = StepSync(group.group, group.device, cfg.hidden_size, dtype)
    log.info("rank %d of %d ready (%s)", rank, world_size, group.device)
    serve_then_exit(runner, sync)


def serve_then_exit(runner: Any, sync: StepSync) -> NoReturn:
    """``serve`` until STOP, then end the process at once with status 0, or 1 when a
    call fails (logged; rank 0 sees this rank go and exits too). No collective teardown:
    it would wait for rank 0's (``group.exit_process``)."""
    try:
        serve(runner, sync)
    except BaseException:
        log.exception("tensor parallel: a model call failed on this rank")
        tp_group.exit_process(1)
    tp_group.exit_process(0)


@torch.inference_mode()
def serve(runner: Any, sync: StepSync) -> None:
    """Run rank 0's model calls on this rank's shard until STOP: ``runner`` is this
    rank's ``ModelRunner`` (its model, KV cache, backend, decode and mixed-step graphs)."""
    while True:
        header = sync.recv_header()
        op = header[0]
        if op == OP_STOP:
            return
        if op == OP_FORWARD:
            ids, positions, meta = sync.recv_forward(header)
            runner.model(ids, positions, runner.kv_caches, meta, runner.backend)
        elif op == OP_LOGITS:
            runner.model.compute_logits(sync.recv_hidden(header))
        elif op == OP_DECODE:
            graphs = runner.graphs
            sync.recv_into(graphs.inputs.dev64, graphs.inputs.dev32)
            graphs.run(header[1], header[2], upload=False)
        elif op == OP_MIXED:
            mixed = runner.mixed
            sync.recv_into(mixed.inputs.dev64, mixed.inputs.dev32)
            mixed.replay(header[1], header[2]).finish()
        else:
            raise RuntimeError(f"tensor parallel: unknown op {op} from rank 0")
