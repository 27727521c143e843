//! Undoing an insert: the router inserts a prompt for the chosen worker at decision
//! time (so a burst of the same prefix sticks to it), and rolls the insert back when the
//! worker refuses the request (a 4xx/5xx before any output, or the attempt failed).
//!
//! `rollback(w, tokens, keep)` makes `w` stop holding `tokens` past its first `keep`
//! tokens, walking the path up from its deepest node and dropping `w` from each node it
//! holds as a leaf (no child held by `w`), the node at `keep` split if `keep` falls
//! inside its edge. It stops at the first node `w` does not hold or holds for another of
//! its prefixes: what another insert of `w` still needs is kept. `keep` is what
//! `insert` reported as held before (`Inserted::held_before`).

use super::{Symbol, Tree, ROOT};

impl<T: Symbol> Tree<T> {
    /// Make `worker` stop holding `tokens` beyond its first `keep` tokens (see the
    /// module comment); returns the tokens dropped. Unknown workers are ignored.
    pub fn rollback(&mut self, worker: &str, tokens: &[T], keep: u64) -> u64 {
        let Some(wid) = self.worker_id(worker) else {
            return 0;
        };
        self.epoch += 1;
        // Nodes on the path whose edge lies wholly within `tokens`, root first.
        let mut path: Vec<u32> = Vec::with_capacity(8);
        let mut cur = ROOT;
        let mut pos = 0usize;
        while pos < tokens.len() {
            let Some(child) = self.nodes[cur as usize].children.get(tokens[pos]) else {
                break;
            };
            let edge = &self.nodes[child as usize].edge;
            if tokens.len() - pos < edge.len() || tokens[pos..pos + edge.len()] != edge[..] {
                break;
            }
            pos += edge.len();
            path.push(child);
            cur = child;
        }
        let mut dropped = 0u64;
        for &id in path.iter().rev() {
            let (end, len) = {
                let n = &self.nodes[id as usize];
                (u64::from(n.end_depth), n.edge.len() as u64)
            };
            if end <= keep {
                break;
            }
            let leaf = matches!(
                self.nodes[id as usize].holder_pos(wid),
                Ok(i) if self.nodes[id as usize].holders[i].children == 0
            );
            if !leaf {
                break;
            }
            let start = end - len;
            if start < keep {
                // Keep the first part of the edge: split, drop only the lower node.
                self.split(id, (keep - start) as usize);
                self.drop_holder(wid, id);
                dropped += end - keep;
                break;
            }
            self.drop_holder(wid, id);
            dropped += len;
        }
        dropped
    }
}
