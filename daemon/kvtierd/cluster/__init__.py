"""The cluster tier: blocks shared between hosts through Mooncake Store.

* ``format`` -- what kvtier stores in the cluster: object names derived from the
  cluster secret, the namespace and its geometry; the tagged header each object
  carries after its data;
* ``agent``  -- the child process that runs the Mooncake client (``python -m
  kvtierd.cluster.agent``): it maps the daemon's DRAM segments, registers them
  with the transfer engine and moves bytes straight between them and the
  cluster;
* ``link``   -- the agent process from the daemon's side:
  :class:`~kvtierd.cluster.link.AgentLink` starts it, restarts it with back-off,
  kills it when it hangs, sends it requests and fails them fast while the master
  does not answer (``MasterBreaker``);
* ``slots``  -- DRAM slots named to the agent as (segment id, offset):
  :class:`~kvtierd.cluster.slots.SlotMapper` has the agent map each segment
  (ahead of its first publish) and unmap the retired ones;
* ``tier``   -- :class:`~kvtierd.cluster.tier.ClusterTier`, the
  ``spill.tier.LowerTier`` over the two: it turns tier calls into requests and
  the agent's answers into hits, misses and counted faults.

Why a child process (docs/decisions.md "The cluster tier on Mooncake Store"):
Mooncake's ``setup`` holds the GIL for up to 90 s when the master is down, a
transfer into memory a client cut away raises SIGBUS, and a bad buffer size
segfaults.  In the agent each of those costs the cluster tier a restart; in the
daemon it would cost every local hit.
"""
