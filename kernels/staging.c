/* staging.c: staged transfers between files and the device (model/ops.h,
 * stage_in and stage_out): two page-locked host buffers of STAGE_BYTES,
 * allocated on the first transfer and kept until mn_cuda_empty_cache, take
 * a big tensor through the host piece by piece. While the host fills one
 * buffer (a file read), the other is on its way to the device; on the way
 * out, the next piece is downloaded while the host writes the last one. So
 * `mnemo run` never makes a host copy of k, v or y, and every copy runs at
 * the bus's page-locked speed. Copies go to the current stream (cuda.h),
 * where the engine's kernels run, and each transfer waits for its last copy
 * before it returns: a buffer is never refilled while a copy reads it, and
 * a tensor filled by stage_in is complete when the call returns. */
#include "cuda_check.h"
#include "cuda_ops.h"

#include <string.h>

/* Big enough that a piece's fixed costs (a file call, a copy launch) are
 * noise, small enough that pinning both takes milliseconds, not the tens a
 * whole P1-sized input would cost to pin. */
enum { STAGE_BYTES = 16 << 20 };

static struct {
    void *buf[2];
    cudaEvent_t done[2]; /* the last copy that used buf[i] */
    bool used[2];        /* done[i] was recorded since the last wait */
} ring;

void mn_cuda_staging_release(void)
{
    for (int i = 0; i < 2; i++) {
        if (ring.buf[i] && cudaFreeHost(ring.buf[i]) != cudaSuccess) (void)cudaGetLastError();
        if (ring.done[i] && cudaEventDestroy(ring.done[i]) != cudaSuccess) (void)cudaGetLastError();
    }
    memset(&ring, 0, sizeof ring);
}

static mn_status ring_ready(void)
{
    if (ring.buf[1]) return MN_OK;
    MN_TRY(mn_cuda_ensure_device());
    mn_status st = MN_OK;
    for (int i = 0; i < 2 && st == MN_OK; i++) {
        st = MN_CUDA_ST(cudaEventCreateWithFlags(&ring.done[i], cudaEventDisableTiming));
        if (st == MN_OK) st = MN_CUDA_ST(cudaHostAlloc(&ring.buf[i], STAGE_BYTES, cudaHostAllocDefault));
    }
    if (st != MN_OK) mn_cuda_staging_release(); /* whatever half was made */
    return st;
}

/* Waits for the last copy through buffer i; the first error is kept. */
static mn_status wait_buffer(int i, mn_status st)
{
    if (!ring.used[i]) return st;
    ring.used[i] = false;
    mn_status w = MN_CUDA_ST(cudaEventSynchronize(ring.done[i]));
    return st != MN_OK ? st : w;
}

static mn_status copy_piece(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, int i)
{
    cudaStream_t stream = (cudaStream_t)mn_cuda_get_stream();
    MN_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, kind, stream));
    MN_CUDA_CHECK(cudaEventRecord(ring.done[i], stream));
    ring.used[i] = true;
    return MN_OK;
}

/* The size io gives the piece at offset, checked: the loops below trust it. */
static mn_status next_piece(const mn_stage_io *io, size_t offset, size_t nbytes, size_t *n)
{
    *n = io->piece(io->ctx, offset, STAGE_BYTES);
    if (*n == 0 || *n > STAGE_BYTES || *n > nbytes - offset)
        return mn_fail(MN_ERR_ARG, "cuda staging: a piece of %zu bytes at offset %zu of %zu (buffers of %d bytes)", *n,
                       offset, nbytes, (int)STAGE_BYTES);
    return MN_OK;
}

mn_status mn_cuda_stage_in(void *dev, size_t nbytes, const mn_stage_io *io)
{
    MN_TRY(ring_ready());
    mn_status st = MN_OK;
    char *dst = dev;
    size_t n = 0;
    for (size_t off = 0, k = 0; off < nbytes && st == MN_OK; off += n, k++) {
        int i = (int)(k & 1); /* alternate: the other buffer's copy is in flight */
        st = wait_buffer(i, next_piece(io, off, nbytes, &n));
        if (st == MN_OK) st = io->move(io->ctx, off, n, ring.buf[i]);
        if (st == MN_OK) st = copy_piece(dst + off, ring.buf[i], n, cudaMemcpyHostToDevice, i);
    }
    st = wait_buffer(0, st);
    return wait_buffer(1, st);
}

mn_status mn_cuda_stage_out(const void *dev, size_t nbytes, const mn_stage_io *io)
{
    if (nbytes == 0) return MN_OK;
    MN_TRY(ring_ready());
    const char *src = dev;
    size_t off = 0, n = 0, next_off, next_n = 0;
    int i = 0;
    /* One piece ahead: piece k+1 downloads into the other buffer while the
     * host writes piece k out. */
    mn_status st = next_piece(io, 0, nbytes, &n);
    if (st == MN_OK) st = copy_piece(ring.buf[0], src, n, cudaMemcpyDeviceToHost, 0);
    while (st == MN_OK && off < nbytes) {
        next_off = off + n;
        if (next_off < nbytes) {
            st = next_piece(io, next_off, nbytes, &next_n);
            if (st == MN_OK) st = copy_piece(ring.buf[1 - i], src + next_off, next_n, cudaMemcpyDeviceToHost, 1 - i);
        }
        st = wait_buffer(i, st);
        if (st == MN_OK) st = io->move(io->ctx, off, n, ring.buf[i]);
        off = next_off;
        n = next_n;
        i = 1 - i;
    }
    st = wait_buffer(0, st);
    return wait_buffer(1, st);
}
