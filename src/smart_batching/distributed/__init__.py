"""The distributed room: one balanced plan for every rank, and what keeps the ranks in step.

====================  ================================================================================
module                job
====================  ================================================================================
``distribute``        :func:`distribute`: deal a plan's batches to ranks as micro-batches, every step
                      even (phases: cost, deal, tail, balance, reform, shuffle, costliest first; see
                      its docstring), into a :class:`DistributedPlan`
``world``             :class:`World`, the topology, read from ``torch.distributed`` in one place
``_balance``          evening out one step within the strategy's limits (repartition, moves, swaps)
``_reform``           re-forming the steps balancing leaves uneven, with their neighbours
``sampler``           :class:`~smart_batching.distributed.sampler.DistributedSmartBatchSampler` (torch)
``even_steps``        lockstep batch counts across ranks for streamed data (torch)
``launch``            starting a module on several processes with torchrun
====================  ================================================================================

``import smart_batching.distributed`` loads NumPy only; the torch modules load when imported.
"""

from smart_batching.distributed.distribute import (
    COSTS,
    DistributedPlan,
    distribute,
    micro_batch_costs,
    unit_costs,  # noqa: F401 (the former name of micro_batch_costs)
)
from smart_batching.distributed.world import World, shutdown

__all__ = ["COSTS", "DistributedPlan", "World", "distribute", "micro_batch_costs", "shutdown"]
