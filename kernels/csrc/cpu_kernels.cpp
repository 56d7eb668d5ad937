// The CPU kernels as one translation unit (kernels/cpu_extension.py builds this file only):
// ATen's and pybind11's headers are then parsed once instead of once per source, which
// cuts the one-off build's CPU time (measured in that module's docstring).

#include "decode_attention_cpu.cpp"
#include "elementwise_cpu.cpp"
#include "bindings.cpp"
