"""Parallel layouts of a GPT: what `parallel.*` in the config selects, behind one interface.

    config ──> Layout.of(cfg, world)      parallel/layout.py    degrees pp x dp x tp, every world-size check
           ──> build_strategy(cfg, env)   parallel/registry.py                 the mesh + the data-parallel strategy
           ──> strategy.setup(model)      parallel/parallelize.py  pp split -> tp -> checkpointing -> dp -> compile
           ──> Trainer                    trainer.py            calls only Strategy methods

`parallel.strategy` (+ `zero_stage`) picks the Strategy class, the engine of the data-parallel
dimension; tensor and pipeline parallelism compose with it inside `parallelize`. Where each
part lives:

    strategy.py    Strategy: the interface and `none`      ddp.py     DDP
    zero.py        ZeRO-1/2 (element sharding), ZeRO-3     fsdp.py    FSDP2 fully_shard
    zero_shard.py  ZeRO-1/2's slices and bucketed collectives
    dp.py          nn.DataParallel (one process, all GPUs)
    tp.py          Megatron tensor parallelism (DTensor parallelize_module)
    pp.py          pipeline stages and schedule (torch.distributed.pipelining): a StepRunner
    step.py        StepRunner and the micro-batch loop     scaler.py  fp16 grad scalers
    dtensor.py     DTensor helpers                         env.py     process group start-up
    options.py     Engine (the strategy's one name) and the config-only rules of parallel.*
    registry.py    Engine -> Strategy class, build_strategy

This file imports nothing, so that config.py can read parallel/options.py without loading torch.
"""
