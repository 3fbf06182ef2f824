"""Device tooling (tools/device/README.md): the sm_90a compile report, probes, sweeps and models
of the GPU kernels, the Triton wheel carried to a device call, and the lease runner. Nothing in
``primal_dual`` imports it; it reaches the kernels through their public names only. Its modules
import nothing here, so ``python3 -m tools.device.lease`` runs on a bare Python."""
