"""Parallelism: the device mesh and sharding rules (``sharding``), context parallelism over a ``seq`` axis
(``context``), multi-host start-up (``distributed``), device memory (``device_memory``). It sits below the model and
the caches: it imports only the kernels and the config plumbing (``names`` holds what config modules check against)."""
