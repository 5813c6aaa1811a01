"""The fused attention kernels and the table that chooses one for a case
(fused.py): cuDNN's, splash and Triton flash attention called as dense
would be (fused_kernels.py, cudnn_packed.py), and the project's general
kernel of score functions, block patterns and sinks (flex.py, its two
backends flex_gpu.py and flex_tpu.py). Imports only core/."""
