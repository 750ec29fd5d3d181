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

use std::collections::BTreeSet;

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

/// One block of a segment.
#[derive(Clone, Copy, Debug)]
struct Block {
    offset: u64,
    size: u64,
    free: bool,
}

/// One `cudaMalloc`: its blocks in address order. A segment holds a few
/// blocks (a large one usually one or two), so a sorted vector beats a
/// tree here; the planner replays every allocation of a step through it.
#[derive(Clone, Debug)]
struct Segment {
    pool: Pool,
    blocks: Vec<Block>,
}

impl Segment {
    /// The index of the block that starts at `offset`.
    fn at(&self, offset: u64) -> usize {
        self.blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .expect("a block starts there")
    }
}

/// Where a live allocation sits; `seg == FREED` once freed.
#[derive(Clone, Copy, Debug)]
struct Place {
    seg: u32,
    offset: u64,
}

const FREED: u32 = u32::MAX;

/// The allocator's state and its high-water marks.
#[derive(Clone, Debug, Default)]
pub struct CachingAllocator {
    segments: Vec<Segment>,
    /// Free blocks per pool, ordered as the allocator searches them: size,
    /// then address (segment, offset).
    free: [BTreeSet<(u64, u32, u64)>; 2],
    /// Every allocation, by id (ids count up from 1): where it sits.
    places: Vec<Place>,
    allocated: u64,
    reserved: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

impl CachingAllocator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Allocates `bytes` (> 0) and returns the allocation's id.
    pub fn malloc(&mut self, bytes: u64) -> u64 {
        let size = round_size(bytes);
        let pool = if size <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        };
        let free = &mut self.free[pool as usize];
        let found = free.range((size, 0, 0)..).next().copied();
        let (seg, offset, block) = match found {
            Some(key @ (block, seg, offset)) => {
                free.remove(&key);
                (seg, offset, block)
            }
            None => {
                let total = segment_size(size);
                self.segments.push(Segment {
                    pool,
                    blocks: vec![Block {
                        offset: 0,
                        size: total,
                        free: true,
                    }],
                });
                self.reserved += total;
                self.peak_reserved = self.peak_reserved.max(self.reserved);
                let seg = u32::try_from(self.segments.len() - 1).expect("under 2^32 segments");
                (seg, 0, total)
            }
        };
        let rest = block - size;
        let split = match pool {
            Pool::Small => rest >= MIN_BLOCK,
            Pool::Large => rest > SMALL_SIZE,
        };
        let used = if split { size } else { block };
        let s = &mut self.segments[seg as usize];
        let i = s.at(offset);
        s.blocks[i] = Block {
            offset,
            size: used,
            free: false,
        };
        if split {
            s.blocks.insert(
                i + 1,
                Block {
                    offset: offset + size,
                    size: rest,
                    free: true,
                },
            );
            self.free[pool as usize].insert((rest, seg, offset + size));
        }
        self.allocated += used;
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        self.places.push(Place { seg, offset });
        self.places.len() as u64
    }

    /// Frees allocation `id`: merged with free neighbours, back to its pool.
    pub fn free(&mut self, id: u64) {
        let Some(place) = (id as usize)
            .checked_sub(1)
            .and_then(|i| self.places.get_mut(i))
            .filter(|p| p.seg != FREED)
        else {
            return;
        };
        let (seg, offset) = (place.seg, place.offset);
        place.seg = FREED;
        let s = &mut self.segments[seg as usize];
        let free = &mut self.free[s.pool as usize];
        let mut i = s.at(offset);
        self.allocated -= s.blocks[i].size;
        let (mut start, mut len) = (offset, s.blocks[i].size);
        // The free block after (blocks tile the segment, so a neighbour
        // in the vector is a neighbour in memory).
        if let Some(&next) = s.blocks.get(i + 1)
            && next.free
        {
            free.remove(&(next.size, seg, next.offset));
            s.blocks.remove(i + 1);
            len += next.size;
        }
        // The free block before.
        if i > 0 && s.blocks[i - 1].free {
            let prev = s.blocks[i - 1];
            free.remove(&(prev.size, seg, prev.offset));
            s.blocks.remove(i);
            i -= 1;
            start = prev.offset;
            len += prev.size;
        }
        s.blocks[i] = Block {
            offset: start,
            size: len,
            free: true,
        };
        free.insert((len, seg, start));
    }

    /// The allocator's layout, flattened: every segment's pool and blocks
    /// (offset, size, free) in order. Two allocators with the same layout
    /// serve any sequence of requests alike (the free sets follow from the
    /// blocks; which id sits in a block does not matter), which is what a
    /// planner's fast-forward over identical micro-batches checks.
    pub fn layout(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(2 + 4 * self.segments.len());
        out.extend([self.allocated, self.reserved]);
        for s in &self.segments {
            out.push(((s.pool as u64) << 32) | s.blocks.len() as u64);
            for b in &s.blocks {
                out.extend([b.offset, b.size, b.free as u64]);
            }
        }
        out
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
