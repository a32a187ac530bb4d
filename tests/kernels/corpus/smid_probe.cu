// out[block] = the SM the block ran on. Idempotent.
extern "C" __global__ void smid_probe(unsigned int* out) {
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    if (threadIdx.x == 0) out[blockIdx.x] = sm;
}
