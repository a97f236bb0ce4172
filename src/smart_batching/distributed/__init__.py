"""The distributed room: one balanced plan for every rank, and what keeps the ranks in step.

====================  ================================================================================
module                job
====================  ================================================================================
``plan``              :func:`distribute`: deal a plan's micro-batches to ranks, every step even
                      (phases: cost, deal, tail, balance, reform, shuffle; see its docstring);
                      :class:`World`, the topology, read from ``torch.distributed`` in one place
``_balance``          evening out one step within the strategy's limits (repartition, moves, swaps)
``_reform``           re-forming the steps balancing leaves uneven, with their neighbours
``sampler``           :class:`~smart_batching.distributed.sampler.DistributedSmartBatchSampler` (torch)
``even_steps``        lockstep batch counts across ranks for streamed data (torch)
``launch``            starting a module on several processes with torchrun
====================  ================================================================================

``import smart_batching.distributed`` loads NumPy only; the torch modules load when imported. The old
paths (``smart_batching.distributed_sampler``, ``smart_batching.even_steps``) still work.
"""

from smart_batching.distributed.plan import COSTS, DistributedPlan, World, distribute, shutdown, unit_costs

__all__ = ["COSTS", "DistributedPlan", "World", "distribute", "shutdown", "unit_costs"]
