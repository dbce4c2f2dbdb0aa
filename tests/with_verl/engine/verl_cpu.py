"""verl ≥ 0.9 on a machine without an accelerator, for tests only: verl knows CUDA / NPU / ROCm platforms and falls
back to CUDA; this registers a CPU platform (gloo, no device memory) and selects it with VERL_PLATFORM=cpu. Import
it before anything asks verl for its platform (in every process of a test: torchrun children included)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


class _CpuDevice:
    """What verl calls on `torch.cuda`-like device modules, for the CPU (memory counters are 0)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(*args: Any) -> str:
        return "CPU"

    @staticmethod
    def mem_get_info(*args: Any) -> tuple[int, int]:
        """(free, total) device memory."""
        return 0, 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("max_memory", "memory_", "reset_peak", "reset_max")):
            return lambda *args, **kwargs: 0
        if name == "empty_cache":  # no device memory to free
            return lambda *args, **kwargs: None
        return getattr(torch.cpu, name)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CpuDevice()

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> str:
        """What verl passes wherever torch takes a device (`module.to(get_device_id())`)."""
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CPU_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        """Ray's accelerator resource: verl's trainer places one worker per "GPU" (the test's Ray cluster declares
        as many as it wants workers)."""
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


os.environ["VERL_PLATFORM"] = "cpu"
