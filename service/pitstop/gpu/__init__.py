"""GPU inventory and health (NVML); says "not present" plainly on hosts without GPUs."""
