//! PyTorch's CUDA caching allocator, modelled: what `hf-eager` on a GPU
//! reserves (`torch.cuda.max_memory_reserved`) for the tensors it allocates
//! (`max_memory_allocated`, each rounded to a block).
//!
//! The rules follow c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x, default
//! `PYTORCH_CUDA_ALLOC_CONF`), one stream:
//! * a request is rounded up to a multiple of 512 bytes (`kMinBlockSize`);
//! * requests of at most 1 MiB (`kSmallSize`) are served from the small
//!   pool, whose segments are 2 MiB (`kSmallBuffer`); larger ones from the
//!   large pool, whose segments are 20 MiB (`kLargeBuffer`) for requests
//!   under 10 MiB (`kMinLargeAlloc`) and the request rounded up to 2 MiB
//!   (`kRoundLarge`) otherwise;
//! * a free block is found best-fit (the smallest free block of the pool at
//!   least as large, lowest address first); it is split when what remains is
//!   at least 512 bytes (small pool) or more than 1 MiB (large pool);
//! * a freed block merges with free neighbours of its segment and returns
//!   to its pool; segments are never given back (no `empty_cache`), so the
//!   reserved bytes only grow, and when nothing fits a new segment is
//!   `cudaMalloc`ed.
//!
//! Not modelled: `expandable_segments`, `max_split_size_mb` and
//! `roundup_power2_divisions` (off by default), several streams, and the
//! retry that frees cached segments when `cudaMalloc` fails near the
//! capacity (which can make the real reserved peak lower there).

use std::collections::{BTreeMap, BTreeSet, HashMap};

pub const MIN_BLOCK: u64 = 512;
pub const SMALL_SIZE: u64 = 1 << 20;
pub const SMALL_BUFFER: u64 = 2 << 20;
pub const LARGE_BUFFER: u64 = 20 << 20;
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
pub const ROUND_LARGE: u64 = 2 << 20;

/// A request's size in the allocator: rounded up to 512 bytes.
pub fn round_size(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(MIN_BLOCK) * MIN_BLOCK
}

/// The segment `cudaMalloc`ed for a (rounded) request that nothing fits.
pub fn segment_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Pool {
    Small,
    Large,
}

/// One `cudaMalloc`: its blocks by offset, `(size, free)`.
#[derive(Clone, Debug)]
struct Segment {
    pool: Pool,
    blocks: BTreeMap<u64, (u64, bool)>,
}

/// The allocator's state and its high-water marks.
#[derive(Clone, Debug, Default)]
pub struct CachingAllocator {
    segments: Vec<Segment>,
    /// Free blocks, ordered as the allocator searches them: pool, size,
    /// then address (segment, offset).
    free: BTreeSet<(Pool, u64, usize, u64)>,
    /// Live allocations: id -> (segment, offset).
    live: HashMap<u64, (usize, u64)>,
    next_id: u64,
    allocated: u64,
    reserved: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

impl CachingAllocator {
    pub fn new() -> Self {
        Self {
            next_id: 1,
            ..Self::default()
        }
    }

    /// Allocates `bytes` (> 0) and returns the allocation's id.
    pub fn malloc(&mut self, bytes: u64) -> u64 {
        let size = round_size(bytes);
        let pool = if size <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        };
        let found = self
            .free
            .range((pool, size, 0, 0)..=(pool, u64::MAX, usize::MAX, u64::MAX))
            .next()
            .copied();
        let (seg, off, block) = match found {
            Some(key @ (_, block, seg, off)) => {
                self.free.remove(&key);
                (seg, off, block)
            }
            None => {
                let total = segment_size(size);
                self.segments.push(Segment {
                    pool,
                    blocks: BTreeMap::from([(0, (total, false))]),
                });
                self.reserved += total;
                self.peak_reserved = self.peak_reserved.max(self.reserved);
                (self.segments.len() - 1, 0, total)
            }
        };
        let rest = block - size;
        let split = match pool {
            Pool::Small => rest >= MIN_BLOCK,
            Pool::Large => rest > SMALL_SIZE,
        };
        let used = if split { size } else { block };
        let s = &mut self.segments[seg];
        s.blocks.insert(off, (used, false));
        if split {
            s.blocks.insert(off + size, (rest, true));
            self.free.insert((pool, rest, seg, off + size));
        }
        self.allocated += used;
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        let id = self.next_id;
        self.next_id += 1;
        self.live.insert(id, (seg, off));
        id
    }

    /// Frees allocation `id`: merged with free neighbours, back to its pool.
    pub fn free(&mut self, id: u64) {
        let Some((seg, off)) = self.live.remove(&id) else {
            return;
        };
        let s = &mut self.segments[seg];
        let pool = s.pool;
        let (size, _) = s.blocks[&off];
        self.allocated -= size;
        let (mut start, mut len) = (off, size);
        // The free block before, if it ends here.
        if let Some((&p, &(psize, true))) = s.blocks.range(..off).next_back()
            && p + psize == off
        {
            self.free.remove(&(pool, psize, seg, p));
            s.blocks.remove(&off);
            start = p;
            len += psize;
        }
        // The free block after.
        if let Some(&(nsize, true)) = s.blocks.get(&(off + size)) {
            self.free.remove(&(pool, nsize, seg, off + size));
            s.blocks.remove(&(off + size));
            len += nsize;
        }
        s.blocks.insert(start, (len, true));
        self.free.insert((pool, len, seg, start));
    }

    /// Bytes in live blocks (each rounded as the allocator rounds it).
    pub fn allocated(&self) -> u64 {
        self.allocated
    }

    /// Bytes in segments.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn rounding_and_segment_sizes_follow_the_constants() {
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(512), 512);
        assert_eq!(round_size(513), 1024);
        assert_eq!(segment_size(MIB), 2 * MIB);
        assert_eq!(segment_size(MIB + 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB), 10 * MIB);
        assert_eq!(segment_size(10 * MIB + 1), 12 * MIB);
    }

    #[test]
    fn small_requests_share_a_two_mib_segment() {
        let mut a = CachingAllocator::new();
        let ids: Vec<u64> = (0..4).map(|_| a.malloc(100_000)).collect();
        // 100000 rounds to 100352; four fit in one 2 MiB segment.
        assert_eq!(a.reserved(), 2 * MIB);
        assert_eq!(a.allocated(), 4 * 100_352);
        for id in ids {
            a.free(id);
        }
        assert_eq!(a.allocated(), 0);
        // Merged back into one free block: a 2 MiB request... is large, so
        // it takes a 20 MiB segment; a 1 MiB one reuses the small segment.
        a.malloc(MIB);
        assert_eq!(a.reserved(), 2 * MIB);
    }

    #[test]
    fn large_blocks_split_only_past_one_mib_and_merge_when_freed() {
        let mut a = CachingAllocator::new();
        // 3 MiB from a 20 MiB segment: 17 MiB remain, split off.
        let x = a.malloc(3 * MIB);
        let y = a.malloc(16 * MIB + 512 * 1024);
        // 16.5 MiB >= 10 MiB: its own 18 MiB segment, not the 17 MiB rest?
        // Best fit: the 17 MiB free block fits 16.5 MiB; the 0.5 MiB rest
        // is not split off (not more than 1 MiB), so the block is used whole.
        assert_eq!(a.reserved(), 20 * MIB);
        assert_eq!(a.allocated(), 20 * MIB);
        a.free(x);
        a.free(y);
        // Both merged: a 20 MiB request fits the one free block.
        a.malloc(20 * MIB);
        assert_eq!(a.reserved(), 20 * MIB);
        assert_eq!(a.peak_reserved, 20 * MIB);
    }

    #[test]
    fn fragmentation_costs_a_new_segment() {
        let mut a = CachingAllocator::new();
        // Two 12 MiB segments' worth, freed with a live block between.
        let p = a.malloc(12 * MIB);
        let q = a.malloc(12 * MIB);
        a.free(p);
        // A 14 MiB request fits neither the free 12 MiB block nor anything
        // else: a third segment, though 12 MiB sit free.
        a.malloc(14 * MIB);
        assert_eq!(a.reserved(), 38 * MIB);
        assert_eq!(a.allocated(), 26 * MIB);
        a.free(q);
    }
}
