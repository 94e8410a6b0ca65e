//! CPU copies into and out of the platform's host buffers, split across threads when large: one core's `memcpy`
//! reaches a fraction of a server's memory bandwidth, and the hand-over of a model's weights into pinned masters (and
//! their way back at `disable`) is one copy of the whole model. Below [`PARALLEL_COPY_BYTES`] a copy stays on the
//! calling thread (starting threads would cost more than it saves).

/// Copies of at least this many bytes are split across threads (a model's tensors are mostly 10–100 MB).
pub(crate) const PARALLEL_COPY_BYTES: usize = 16 << 20;
/// Each thread copies at least this many bytes (a thread costs tens of microseconds to start; 4 MiB take hundreds).
const BYTES_PER_THREAD: usize = 4 << 20;
/// At most this many threads share one copy (memory bandwidth, not cores, is the limit beyond a few).
const MAX_COPY_THREADS: usize = 8;

/// A destination pointer handed to the copy threads.
#[derive(Clone, Copy)]
struct Dst(*mut u8);

// SAFETY: each thread writes a disjoint range of the destination (see `copy_to`), which the caller holds exclusively
// for the duration of the copy; the pointer is only an address.
unsafe impl Send for Dst {}

/// How many threads copy `len` bytes.
fn threads_for(len: usize) -> usize {
    if len < PARALLEL_COPY_BYTES {
        return 1;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(MAX_COPY_THREADS).min(len / BYTES_PER_THREAD)
}

/// Copies `src` to `dst`.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes, must not overlap `src`, and nothing else may read or write
/// those bytes during the call.
pub(crate) unsafe fn copy_to(src: &[u8], dst: *mut u8) {
    let threads = threads_for(src.len());
    if threads <= 1 {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        return;
    }
    let chunk = src.len().div_ceil(threads);
    let dst = Dst(dst);
    std::thread::scope(|s| {
        for (i, part) in src.chunks(chunk).enumerate() {
            s.spawn(move || {
                let d = dst;
                // SAFETY: `part` is the `i`-th chunk of `src`, so `i * chunk + part.len() <= src.len()`: the range
                // lies inside the destination the caller lent, disjoint from the other threads' ranges.
                unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), d.0.add(i * chunk), part.len()) };
            });
        }
    });
}

/// Copies `out.len()` bytes from `src` into `out`.
///
/// # Safety
/// `src` must be valid for reads of `out.len()` bytes, must not overlap `out`, and nothing may write those bytes
/// during the call.
pub(crate) unsafe fn copy_from(src: *const u8, out: &mut [u8]) {
    let threads = threads_for(out.len());
    if threads <= 1 {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        return;
    }
    let chunk = out.len().div_ceil(threads);
    let src = Dst(src.cast_mut());
    std::thread::scope(|s| {
        for (i, part) in out.chunks_mut(chunk).enumerate() {
            s.spawn(move || {
                let from = src;
                // SAFETY: the `i`-th chunk's source range `i * chunk .. + part.len()` lies inside the `out.len()`
                // readable bytes the caller lent; `part` is this thread's own slice of `out`.
                unsafe { std::ptr::copy_nonoverlapping(from.0.add(i * chunk), part.as_mut_ptr(), part.len()) };
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
    }

    #[test]
    fn large_and_small_copies_move_every_byte_and_nothing_else() {
        for len in [0, 1, 4095, PARALLEL_COPY_BYTES - 1, PARALLEL_COPY_BYTES + 4099] {
            let src = pattern(len);
            // A guard byte on each side: nothing outside the range is written.
            let mut dst = vec![0x5Au8; len + 2];
            // SAFETY: `dst[1..]` holds `len + 1 >= len` writable bytes, distinct from `src`.
            unsafe { copy_to(&src, dst.as_mut_ptr().add(1)) };
            assert_eq!((dst[0], dst[len + 1]), (0x5A, 0x5A), "{len}");
            assert!(dst[1..=len] == src[..], "copy_to of {len} bytes");
            let mut back = vec![0u8; len];
            // SAFETY: `dst[1..]` holds `len` readable bytes, distinct from `back`.
            unsafe { copy_from(dst.as_ptr().add(1), &mut back) };
            assert!(back == src, "copy_from of {len} bytes");
        }
    }
}
