"""C++ kernels of the CPU decode path (paged decode attention, RMSNorm, rotary, SiLU-and-mul,
KV write), built on the machine that runs them; torch references are the layers' own code."""
