/* The shard hasher's inner loop: pread a file range into a buffer and feed it to OpenSSL's sha256,
 * all in one call, so the Python thread that calls it (through ctypes, which releases the GIL for
 * the call) never has to take the GIL back per chunk. Built on first use by hash_native.py.
 *
 * No OpenSSL header is needed: the caller passes the EVP_MD_CTX and the address of
 * EVP_DigestUpdate from the libcrypto that Python's own _hashlib uses. */
#define _FILE_OFFSET_BITS 64
#define _XOPEN_SOURCE 700
#define _DEFAULT_SOURCE /* MAP_POPULATE */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

typedef int (*digest_update_fn)(void *ctx, const void *data, size_t n);

/* Hash bytes [offset, offset + length) of fd into ctx, reading at most bufsize bytes at a time into
 * buf. Returns the bytes hashed, and in *status why it stopped: 0 (the whole range, or fewer bytes
 * when the file ended first), an errno (a read failed), -1 (check_ff is set and a chunk holds the
 * byte 0xFF; that chunk is not hashed), -2 (EVP_DigestUpdate failed). */
int64_t mxfp4conv_hash_range(int fd, int64_t offset, int64_t length, void *ctx, digest_update_fn update,
                             unsigned char *buf, int64_t bufsize, int check_ff, int *status)
{
    int64_t done = 0;
    *status = 0;
    if (bufsize <= 0) {
        *status = EINVAL;
        return 0;
    }
    while (done < length) {
        int64_t left = length - done;
        size_t want = (size_t)(left < bufsize ? left : bufsize);
        ssize_t got = pread(fd, buf, want, (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            *status = errno;
            return done;
        }
        if (got == 0)
            return done; /* the file ended inside the range */
        if (check_ff && memchr(buf, 0xFF, (size_t)got) != NULL) {
            *status = -1;
            return done;
        }
        if (update(ctx, buf, (size_t)got) != 1) {
            *status = -2;
            return done;
        }
        done += got;
    }
    return done;
}

/* Windows of the mapped hash: what is mapped at once (mapped page-cache pages count in the RSS). */
#define MAP_WINDOW (16 << 20)

/* mxfp4conv_hash_range for a file nobody else writes (the shard being written, once its range is in
 * it): the page cache hashed in place through a read-only mapping, one window at a time, with no copy
 * into a buffer. The range is checked against the file's size first: a mapping past the end would
 * fault, not read short. Where mmap fails, the pread loop (through buf) does the rest. */
int64_t mxfp4conv_hash_mapped(int fd, int64_t offset, int64_t length, void *ctx, digest_update_fn update,
                              unsigned char *buf, int64_t bufsize, int *status)
{
    struct stat st;
    int64_t done = 0;
    long page = sysconf(_SC_PAGESIZE);
    *status = 0;
    if (fstat(fd, &st) != 0) {
        *status = errno;
        return 0;
    }
    if ((int64_t)st.st_size < offset + length)
        length = st.st_size > offset ? (int64_t)st.st_size - offset : 0; /* hashed short: the caller says why */
    while (done < length) {
        int64_t at = offset + done, start = at - at % page, left = length - done;
        int64_t n = left < MAP_WINDOW ? left : MAP_WINDOW;
        int flags = MAP_SHARED;
#ifdef MAP_POPULATE
        flags |= MAP_POPULATE; /* one pass over the page tables, not a fault per page */
#endif
        unsigned char *m = mmap(NULL, (size_t)(n + at - start), PROT_READ, flags, fd, (off_t)start);
        if (m == MAP_FAILED) {
            int st2 = 0;
            int64_t got = mxfp4conv_hash_range(fd, at, left, ctx, update, buf, bufsize, 0, &st2);
            *status = st2;
            return done + got;
        }
        int ok = update(ctx, m + (at - start), (size_t)n) == 1;
        munmap(m, (size_t)(n + at - start));
        if (!ok) {
            *status = -2;
            return done;
        }
        done += n;
    }
    return done;
}
