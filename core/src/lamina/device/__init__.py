"""Layer 5, the device layer: DeviceHandle, Backend, KernelLauncher, Topology, DeviceMesh."""
