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

/// A slot in the block arena that holds no block.
const NONE: u32 = u32::MAX;

/// One block of a segment, linked to its neighbours in address order (as
/// PyTorch links its `Block`s): merging a freed block with its neighbours
/// needs no search.
#[derive(Clone, Copy, Debug)]
struct Block {
    seg: u32,
    offset: u64,
    size: u64,
    free: bool,
    prev: u32,
    next: u32,
}

/// One `cudaMalloc`: the pool it serves and its first block.
#[derive(Clone, Copy, Debug)]
struct Segment {
    pool: Pool,
    head: u32,
}

/// A free block as the index orders it: by address, then (unique among
/// free blocks, so never compared) its slot.
type FreeBlock = (u32, u64, u32);

/// A pool's free blocks, as the allocator searches them: the smallest
/// block at least as large as the request, then the lowest address
/// (segment, offset). A step's tensors come in a few sizes (a few dozen
/// distinct free sizes among hundreds of free blocks in a 70B plan), so
/// the blocks sit in one bucket per size, the buckets sorted by size and
/// each bucket sorted by address from the highest down: the best fit is
/// the last block of the first bucket that is large enough. This replaced
/// a `BTreeSet` of (size, segment, offset), which was half of a plan's time.
#[derive(Clone, Debug, Default)]
struct FreeIndex {
    /// Each bucket's size, ascending, apart from the buckets themselves:
    /// the search for a size reads these few words and nothing else.
    sizes: Vec<u64>,
    buckets: Vec<Vec<FreeBlock>>,
    /// Emptied buckets' vectors, kept to be reused rather than reallocated.
    spare: Vec<Vec<FreeBlock>>,
}

impl FreeIndex {
    /// The first bucket at least `size` large (`sizes.len()` if none).
    fn first_fit(&self, size: u64) -> usize {
        // A handful of sizes: a scan reads them in order and predicts well.
        (self.sizes.iter())
            .position(|&s| s >= size)
            .unwrap_or(self.sizes.len())
    }

    /// Takes the best fit for `size` out: its size and slot.
    fn take(&mut self, size: u64) -> Option<(u64, u32)> {
        let i = self.first_fit(size);
        let block = *self.sizes.get(i)?;
        let (_, _, slot) = self.buckets[i].pop().expect("buckets are never empty");
        if self.buckets[i].is_empty() {
            self.drop_bucket(i);
        }
        Some((block, slot))
    }

    fn drop_bucket(&mut self, i: usize) {
        self.sizes.remove(i);
        self.spare.push(self.buckets.remove(i));
    }

    fn insert(&mut self, size: u64, free: FreeBlock) {
        let i = self.first_fit(size);
        if self.sizes.get(i) != Some(&size) {
            self.sizes.insert(i, size);
            let bucket = self.spare.pop().unwrap_or_default();
            self.buckets.insert(i, bucket);
        }
        let blocks = &mut self.buckets[i];
        // A freed block is most often among the lowest addresses of its
        // bucket (a plan frees 1.5 blocks past it on average): search from
        // the end.
        let below = (blocks.iter().rev()).take_while(|&&b| b < free).count();
        blocks.insert(blocks.len() - below, free);
    }

    fn remove(&mut self, size: u64, free: FreeBlock) {
        let i = self.first_fit(size);
        debug_assert_eq!(self.sizes.get(i), Some(&size), "a free block is indexed");
        let blocks = &mut self.buckets[i];
        let at = blocks.partition_point(|&b| b > free);
        debug_assert_eq!(blocks.get(at), Some(&free));
        blocks.remove(at);
        if blocks.is_empty() {
            self.drop_bucket(i);
        }
    }
}

/// A copy of an allocator's layout ([`CachingAllocator::layout`]).
#[derive(Clone, Debug, Default)]
pub struct Layout {
    allocated: u64,
    reserved: u64,
    live_blocks: usize,
    segments: Vec<Segment>,
    blocks: Vec<Block>,
}

impl Layout {
    /// Segment `seg`'s blocks in address order: (offset, size, free).
    fn blocks_of(&self, seg: usize) -> impl Iterator<Item = (u64, u64, bool)> + '_ {
        let mut i = self.segments[seg].head;
        std::iter::from_fn(move || {
            let b = self.blocks.get(i as usize)?;
            i = b.next;
            Some((b.offset, b.size, b.free))
        })
    }
}

impl PartialEq for Layout {
    fn eq(&self, other: &Layout) -> bool {
        (
            self.allocated,
            self.reserved,
            self.live_blocks,
            self.segments.len(),
        ) == (
            other.allocated,
            other.reserved,
            other.live_blocks,
            other.segments.len(),
        ) && (0..self.segments.len()).all(|seg| {
            self.segments[seg].pool == other.segments[seg].pool
                && self.blocks_of(seg).eq(other.blocks_of(seg))
        })
    }
}

/// The allocator's state and its high-water marks.
#[derive(Clone, Debug, Default)]
pub struct CachingAllocator {
    segments: Vec<Segment>,
    /// Every block of every segment, in slots; `vacant` lists the slots
    /// that merged blocks gave up.
    blocks: Vec<Block>,
    vacant: Vec<u32>,
    /// Free blocks per pool.
    free: [FreeIndex; 2],
    /// Every allocation, by id (ids count up from 1): its block's slot, or
    /// `NONE` once freed.
    places: Vec<u32>,
    allocated: u64,
    reserved: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

/// Vectors of allocators and layouts dropped on this thread, emptied, for
/// the next ones: a planner builds an allocator and two snapshots per
/// point, each a few hundred kilobytes, and the kernel zeroing fresh pages
/// for them was a twentieth of a plan's time.
#[derive(Default)]
struct Spare {
    segments: Vec<Vec<Segment>>,
    blocks: Vec<Vec<Block>>,
    places: Vec<Vec<u32>>,
}

/// How many of each vector a thread keeps.
const SPARE: usize = 4;

thread_local! {
    static SPARE_VECS: std::cell::RefCell<Spare> = std::cell::RefCell::default();
}

fn reuse<T>(pick: impl FnOnce(&mut Spare) -> &mut Vec<Vec<T>>) -> Vec<T> {
    SPARE_VECS
        .try_with(|s| pick(&mut s.borrow_mut()).pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

fn give_back<T>(mut v: Vec<T>, pick: impl FnOnce(&mut Spare) -> &mut Vec<Vec<T>>) {
    if v.capacity() == 0 {
        return;
    }
    v.clear();
    let _ = SPARE_VECS.try_with(|s| {
        let mut s = s.borrow_mut();
        let kept = pick(&mut s);
        if kept.len() < SPARE {
            kept.push(v);
        }
    });
}

impl Drop for CachingAllocator {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.segments), |s| &mut s.segments);
        give_back(std::mem::take(&mut self.blocks), |s| &mut s.blocks);
        give_back(std::mem::take(&mut self.places), |s| &mut s.places);
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.segments), |s| &mut s.segments);
        give_back(std::mem::take(&mut self.blocks), |s| &mut s.blocks);
    }
}

impl CachingAllocator {
    pub fn new() -> Self {
        let mut a = Self::default();
        a.segments = reuse(|s| &mut s.segments);
        a.blocks = reuse(|s| &mut s.blocks);
        a.places = reuse(|s| &mut s.places);
        a
    }

    /// A slot for `block`.
    fn slot(&mut self, block: Block) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.blocks[i as usize] = block;
                i
            }
            None => {
                self.blocks.push(block);
                u32::try_from(self.blocks.len() - 1).expect("under 2^32 blocks")
            }
        }
    }

    /// How the free index names the free block in slot `i`.
    fn key(&self, i: u32) -> (u64, FreeBlock) {
        let b = &self.blocks[i as usize];
        (b.size, (b.seg, b.offset, i))
    }

    fn pool(&self, i: u32) -> usize {
        self.segments[self.blocks[i as usize].seg as usize].pool as usize
    }

    /// Allocates `bytes` (> 0) and returns the allocation's id.
    pub fn malloc(&mut self, bytes: u64) -> u64 {
        let size = round_size(bytes);
        let pool = if size <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        };
        let (block, i) = match self.free[pool as usize].take(size) {
            Some(found) => found,
            None => {
                let total = segment_size(size);
                let seg = u32::try_from(self.segments.len()).expect("under 2^32 segments");
                let head = self.slot(Block {
                    seg,
                    offset: 0,
                    size: total,
                    free: true,
                    prev: NONE,
                    next: NONE,
                });
                self.segments.push(Segment { pool, head });
                self.reserved += total;
                self.peak_reserved = self.peak_reserved.max(self.reserved);
                (total, head)
            }
        };
        let rest = block - size;
        let split = match pool {
            Pool::Small => rest >= MIN_BLOCK,
            Pool::Large => rest > SMALL_SIZE,
        };
        let b = self.blocks[i as usize];
        if split {
            let r = self.slot(Block {
                seg: b.seg,
                offset: b.offset + size,
                size: rest,
                free: true,
                prev: i,
                next: b.next,
            });
            if b.next != NONE {
                self.blocks[b.next as usize].prev = r;
            }
            self.blocks[i as usize].next = r;
            self.blocks[i as usize].size = size;
            let (rest, key) = self.key(r);
            self.free[pool as usize].insert(rest, key);
        }
        self.blocks[i as usize].free = false;
        self.allocated += self.blocks[i as usize].size;
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        self.places.push(i);
        self.places.len() as u64
    }

    /// Joins the block in slot `j` onto the block before it, `i`.
    fn absorb(&mut self, i: u32, j: u32) {
        let b = self.blocks[j as usize];
        self.blocks[i as usize].size += b.size;
        self.blocks[i as usize].next = b.next;
        if b.next != NONE {
            self.blocks[b.next as usize].prev = i;
        }
        self.vacant.push(j);
    }

    /// Frees allocation `id`: merged with free neighbours, back to its pool.
    pub fn free(&mut self, id: u64) {
        let Some(place) = (id as usize)
            .checked_sub(1)
            .and_then(|i| self.places.get_mut(i))
            .filter(|p| **p != NONE)
        else {
            return;
        };
        let mut i = std::mem::replace(place, NONE);
        let pool = self.pool(i);
        self.allocated -= self.blocks[i as usize].size;
        // The free block after.
        let next = self.blocks[i as usize].next;
        if next != NONE && self.blocks[next as usize].free {
            let (size, key) = self.key(next);
            self.free[pool].remove(size, key);
            self.absorb(i, next);
        }
        // The free block before.
        let prev = self.blocks[i as usize].prev;
        if prev != NONE && self.blocks[prev as usize].free {
            let (size, key) = self.key(prev);
            self.free[pool].remove(size, key);
            self.absorb(prev, i);
            i = prev;
        }
        self.blocks[i as usize].free = true;
        let (size, key) = self.key(i);
        self.free[pool].insert(size, key);
    }

    /// Segment `seg`'s blocks in address order.
    #[cfg(test)]
    fn blocks_of(&self, seg: usize) -> impl Iterator<Item = &Block> {
        let mut i = self.segments[seg].head;
        std::iter::from_fn(move || {
            let b = self.blocks.get(i as usize)?;
            i = b.next;
            Some(b)
        })
    }

    /// The allocator's layout: its segments and their blocks. Two
    /// allocators with the same layout serve any sequence of requests alike
    /// (the free index follows from the blocks; which id sits in a block,
    /// or which slot holds it, does not matter), which is what a planner's
    /// fast-forward over identical micro-batches checks. Taken as a copy of
    /// the arrays (a plan takes two or three per point, and most are never
    /// compared block by block); compared segment by segment in address
    /// order.
    pub fn layout(&self) -> Layout {
        let mut layout = Layout::default();
        layout.segments = reuse(|s| &mut s.segments);
        layout.blocks = reuse(|s| &mut s.blocks);
        (layout.allocated, layout.reserved) = (self.allocated, self.reserved);
        layout.live_blocks = self.blocks.len() - self.vacant.len();
        layout.segments.extend_from_slice(&self.segments);
        layout.blocks.extend_from_slice(&self.blocks);
        layout
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

    /// The rules again, as plainly as they read: every free block of the
    /// pool scanned for the smallest fit, lowest address first.
    fn best_fit_by_scan(a: &CachingAllocator, pool: Pool, size: u64) -> Option<(u64, u32, u64)> {
        (0..a.segments.len())
            .filter(|&i| a.segments[i].pool == pool)
            .flat_map(|i| {
                (a.blocks_of(i))
                    .filter(|b| b.free && b.size >= size)
                    .map(move |b| (b.size, i as u32, b.offset))
            })
            .min()
    }

    #[test]
    fn the_free_index_finds_what_scanning_every_free_block_finds() {
        // A deterministic mix of sizes that repeat (as a step's tensors do)
        // and odd ones, small and large, freed in a scrambled order.
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let sizes = [3 * MIB, 12 * MIB, 700 * 1024, 64 * 1024, 25 * MIB + 512];
        let mut a = CachingAllocator::new();
        let mut live: Vec<u64> = Vec::new();
        for _ in 0..20_000 {
            let r = next();
            if live.is_empty() || r % 5 < 3 {
                let bytes = if r % 7 == 0 {
                    1 + (next() % (40 * MIB))
                } else {
                    sizes[(next() % sizes.len() as u64) as usize]
                };
                let size = round_size(bytes);
                let pool = if size <= SMALL_SIZE {
                    Pool::Small
                } else {
                    Pool::Large
                };
                let expect = best_fit_by_scan(&a, pool, size);
                let id = a.malloc(bytes);
                let place = a.blocks[a.places[id as usize - 1] as usize];
                match expect {
                    Some((_, seg, offset)) => assert_eq!((place.seg, place.offset), (seg, offset)),
                    None => assert_eq!(place.seg as usize, a.segments.len() - 1),
                }
                live.push(id);
            } else {
                let i = (next() % live.len() as u64) as usize;
                a.free(live.swap_remove(i));
            }
            // The index holds exactly the free blocks.
            let mut indexed: Vec<(u64, u32, u64)> = (a.free.iter())
                .flat_map(|f| f.sizes.iter().zip(&f.buckets))
                .flat_map(|(size, blocks)| blocks.iter().map(|&(s, o, _)| (*size, s, o)))
                .collect();
            let mut free: Vec<(u64, u32, u64)> = (0..a.segments.len())
                .flat_map(|i| {
                    (a.blocks_of(i))
                        .filter(|b| b.free)
                        .map(move |b| (b.size, i as u32, b.offset))
                })
                .collect();
            indexed.sort_unstable();
            free.sort_unstable();
            assert_eq!(indexed, free);
            // Each segment's blocks tile it, linked both ways.
            for seg in 0..a.segments.len() {
                let (mut end, mut prev) = (0, NONE);
                let mut i = a.segments[seg].head;
                while i != NONE {
                    let b = a.blocks[i as usize];
                    assert_eq!((b.seg as usize, b.offset, b.prev), (seg, end, prev));
                    (end, prev, i) = (b.offset + b.size, i, b.next);
                }
            }
        }
        assert!(a.segments.len() > 10, "the mix grew the pools");
    }

    #[test]
    fn layouts_compare_blocks_not_the_slots_that_hold_them() {
        // Two 3 MiB blocks split from one 20 MiB segment and merged back,
        // against one 5 MiB block: different slots, the same layout.
        let mut a = CachingAllocator::new();
        let (x, y) = (a.malloc(3 * MIB), a.malloc(3 * MIB));
        a.free(x);
        a.free(y);
        let mut b = CachingAllocator::new();
        let z = b.malloc(5 * MIB);
        b.free(z);
        assert_ne!(a.blocks.len(), b.blocks.len());
        assert!(a.layout() == b.layout());
        // A block still live, or a segment more, is another layout.
        let before = b.layout();
        let w = b.malloc(3 * MIB);
        assert!(b.layout() != before);
        b.free(w);
        assert!(b.layout() == before);
        b.malloc(30 * MIB);
        b.free(3);
        assert!(b.layout() != before);
    }
}
