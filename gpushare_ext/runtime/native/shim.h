/*
 * What the launch shim's two halves (launch_interpose.c, parkable_memory.c) call of each
 * other.  Nothing else belongs here: each half keeps its own state to itself.
 */
#ifndef GPUSHARE_SHIM_H
#define GPUSHARE_SHIM_H

/* The dlsym that was there before ours (the C library's). */
void *gps_real_dlsym(void *handle, const char *name);

/* parkable_memory.c's stand-in for the driver entry point `name` whose real function is
 * `real`, or NULL when it wraps none of that name.  With `name` NULL: `real` itself if
 * it is one of its stand-ins, else NULL. */
void *gps_wrap_memory_call(const char *name, void *real, int version);

/* Before a launch reaches the driver: parked memory comes back first (a parked range is
 * unmapped, and a kernel touching it would fault the context).  0 when the memory is
 * resident, else the driver's answer to the restore that failed (the launch must then
 * not go on). */
int gps_memory_resident(void);

#endif
