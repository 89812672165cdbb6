/* vkmoe native call path: the host side of an op call whose command buffer is recorded already (write the
   inputs into mapped buffers, submit, wait, read the output) in two C calls instead of a dozen calls into the
   `vulkan` binding and numpy (vkmoe/vk/fastcall.py drives it). A wait longer than the spin goes back to
   Python, which sleeps in slices with its timeout (Ctrl-C is seen between them).

   No Vulkan header and no libvulkan at build time: the handles are opaque, and the three entry points are the
   addresses of the loader functions the `vulkan` binding itself calls (so validation layers see every call). */
#ifndef VKN_CALL_H
#define VKN_CALL_H
#include <stddef.h>
#include <stdint.h>

/* VkResult codes the call path looks at (Vulkan's values). */
enum { VKN_VK_SUCCESS = 0, VKN_VK_NOT_READY = 1 };
/* vkn_call_finish: the submission is still running after the spin (the caller waits for it). vkn_call_submit:
   a checked slot broke its rule; nothing was copied or submitted (vkn_call.rejected says which slot). No entry
   point the call path makes returns a positive VkResult, so neither code can be mistaken for one. */
enum { VKN_PENDING = 1, VKN_REJECTED = 2 };
/* Which entry point failed (vkn_call.failed), for the error message. */
enum { VKN_FAILED_RESET = 1, VKN_FAILED_SUBMIT = 2, VKN_FAILED_STATUS = 3 };
/* How a slot's elements go between the caller's array and the mapped buffer. */
enum { VKN_CONV_COPY = 0, VKN_CONV_I64_TO_I32 = 1, VKN_CONV_F64_TO_F32 = 2, VKN_CONV_F16_TO_F32 = 3 };
/* Host inputs per call; bits per slot in the packed conversion codes. */
enum { VKN_CALL_INPUTS = 4, VKN_CONV_BITS = 4 };

/* Non-dispatchable handles (VkFence) are 64-bit on every ABI; dispatchable ones (VkDevice, VkQueue) pointers. */
typedef int32_t (*vkn_reset_fences_fn)(void *device, uint32_t count, const uint64_t *fences);
typedef int32_t (*vkn_queue_submit_fn)(void *queue, uint32_t count, const void *submits, uint64_t fence);
typedef int32_t (*vkn_get_fence_status_fn)(void *device, uint64_t fence);

/* The value rule of an input slot, checked on the caller's elements (before any conversion, so an int64 that
   the copy would wrap is seen as it is) when the call asks for it: the caller's own check stays the authority
   and names the problem; this only lets a valid input through without it. */
enum { VKN_RULE_NONE = 0,
       VKN_RULE_INDEX = 1,    /* integers (int32 copied, int64 converted) in [0, bound), distinct in each row */
       VKN_RULE_BOUNDED = 2   /* floats (fp16, fp32, fp64) finite with |v| <= limit */ };

/* One end of a call's host transfer: a mapped buffer and how many elements of elem_bytes it takes. */
typedef struct {
    void *mapped;
    uint64_t count;
    uint32_t elem_bytes;
    uint32_t rule;           /* VKN_RULE_* */
    uint32_t row;            /* VKN_RULE_INDEX: elements per row (count is a multiple of it) */
    int64_t bound;           /* VKN_RULE_INDEX */
    double limit;            /* VKN_RULE_BOUNDED */
} vkn_slot;

typedef struct {
    vkn_reset_fences_fn reset_fences;
    vkn_queue_submit_fn queue_submit;
    vkn_get_fence_status_fn get_fence_status;
    void *device;
    void *queue;
    const uint64_t *fence;   /* VkFence[1]: the recorder's fence */
    double spin_s;           /* poll vkGetFenceStatus this long (0: once, e.g. on a CPU device) */
    vkn_slot in[4];          /* VKN_CALL_INPUTS */
    vkn_slot out;
    int failed;              /* set on an error: VKN_FAILED_* */
    int rejected;            /* set on VKN_REJECTED: the slot whose elements broke its rule */
} vkn_call;

/* Check the slots in the bit mask `checks` against their rules (bit i: slot i; its src is not NULL), copy the
   inputs (src[i] NULL: slot i is not written), reset the fence, submit `submit` (one VkSubmitInfo). The caller
   holds the queue's lock. convs: the slots' VKN_CONV_* codes, VKN_CONV_BITS each (slot 0 lowest). Returns 0,
   VKN_REJECTED (c->rejected says which slot; nothing copied or submitted) or the failing call's VkResult
   (c->failed says which). */
int32_t vkn_call_submit(vkn_call *c, const void *submit, uint32_t convs, uint32_t checks, const void *src0,
                        const void *src1, const void *src2, const void *src3);
/* Poll the fence for up to c->spin_s and, once it is signalled, copy the output into dst (NULL: none) with
   conversion conv. Returns 0 (done, output copied), VKN_PENDING (still running, nothing copied: the caller
   sleeps in vkWaitForFences, with its timeout, and calls this again) or the failing call's VkResult. */
int32_t vkn_call_finish(vkn_call *c, uint32_t conv, void *dst);

#endif
