//! A block allocator with the id patterns a real engine produces.

use std::collections::BTreeSet;

use kv_proto::BlockId;

/// How a pool hands out block ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockPattern {
    /// Lowest run of consecutive free blocks (best case: one op per region).
    Contiguous,
    /// Free blocks with gaps between them (worst case: one op per block).
    Scattered,
    /// Random free blocks (a busy engine after a while).
    Random,
}

/// Free blocks of one instance.
#[derive(Debug)]
pub struct BlockPool {
    free: BTreeSet<BlockId>,
    pattern: BlockPattern,
    rng: u64,
}

impl BlockPool {
    /// All of `num_blocks` free.
    pub fn new(num_blocks: u64, pattern: BlockPattern, seed: u64) -> Self {
        let top = BlockId::try_from(num_blocks).unwrap_or(BlockId::MAX);
        Self { free: (0..top).collect(), pattern, rng: seed | 1 }
    }

    /// Free blocks left.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*: reproducible, no dependency.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Takes `n` blocks, or `None` if fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let picked: Vec<BlockId> = match self.pattern {
            BlockPattern::Contiguous => {
                self.contiguous_run(n).unwrap_or_else(|| self.free.iter().take(n).copied().collect())
            }
            BlockPattern::Scattered => {
                let mut picked = Vec::with_capacity(n);
                let mut last: Option<BlockId> = None;
                for &b in &self.free {
                    if picked.len() == n {
                        break;
                    }
                    if last.is_none_or(|l| b > l + 1) {
                        picked.push(b);
                        last = Some(b);
                    }
                }
                if picked.len() < n {
                    let taken: BTreeSet<BlockId> = picked.iter().copied().collect();
                    let rest: Vec<BlockId> = self.free.difference(&taken).take(n - picked.len()).copied().collect();
                    picked.extend(rest);
                }
                picked
            }
            BlockPattern::Random => {
                let mut all: Vec<BlockId> = self.free.iter().copied().collect();
                for i in 0..n {
                    let j = i + (self.next_random() % (all.len() - i) as u64) as usize;
                    all.swap(i, j);
                }
                all.truncate(n);
                all
            }
        };
        for b in &picked {
            self.free.remove(b);
        }
        Some(picked)
    }

    fn contiguous_run(&self, n: usize) -> Option<Vec<BlockId>> {
        if n == 0 {
            return Some(Vec::new());
        }
        let mut start: Option<BlockId> = None;
        let mut len = 0usize;
        for &b in &self.free {
            match start {
                Some(s) if s as usize + len == b as usize => len += 1,
                _ => {
                    start = Some(b);
                    len = 1;
                }
            }
            if len == n {
                let s = start?;
                return Some((s..s + n as BlockId).collect());
            }
        }
        None
    }

    /// Returns blocks to the pool.
    pub fn free(&mut self, blocks: &[BlockId]) {
        self.free.extend(blocks.iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_give_the_promised_shapes() {
        let mut p = BlockPool::new(100, BlockPattern::Contiguous, 1);
        assert_eq!(p.alloc(3).unwrap(), vec![0, 1, 2]);
        let mut s = BlockPool::new(100, BlockPattern::Scattered, 1);
        let got = s.alloc(5).unwrap();
        assert!(got.windows(2).all(|w| w[1] > w[0] + 1), "{got:?}");
        let mut r = BlockPool::new(100, BlockPattern::Random, 7);
        let got = r.alloc(50).unwrap();
        let unique: BTreeSet<_> = got.iter().collect();
        assert_eq!(unique.len(), 50);
        assert_eq!(r.free_count(), 50);
        r.free(&got);
        assert_eq!(r.free_count(), 100);
        assert!(r.alloc(101).is_none());
    }
}
