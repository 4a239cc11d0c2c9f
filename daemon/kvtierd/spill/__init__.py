"""The spill tiers below DRAM: mechanism only.

* ``blockio``  -- every syscall the tiers make (the fault-injection seam),
  and the O_DIRECT probe;
* ``format``   -- the on-disk formats: SSD spill files (slot table + data)
  and shared-tier block files (header + data);
* ``ssd``      -- the local SSD tier: preallocated slot files, its own index,
  CLOCK eviction and capacity, re-adoption at start (``SsdTier``, over
  ``ssd_files``, ``ssd_index``, ``ssd_alloc``, ``ssd_adopt`` and ``ssd_check``);
* ``tier``     -- the ``LowerTier`` protocol every tier below DRAM implements, and
  the adapters that give the SSD and shared tiers its shape;
* ``shared``   -- the shared-filesystem tier: content-addressed block files
  any host's daemon can read, with no coordinator.

Policy -- which block moves when -- is ``kvtierd.tiering``'s.  Every blocking
call here runs on a worker thread, never on the event loop; the SSD tier's
index methods are cheap and safe to call from the loop.
"""
