//! Which AllGather a distributed GPU run uses, agreed by every rank: NCCL's copy-engine AllGather (symmetric
//! windows, no SMs) or its kernel AllGather.
//!
//! Each rank offers what it can do — whether its NCCL runs the copy-engine AllGather and which node it is on — and
//! every rank decides from all the offers ([`choose_engine`]), so every rank decides alike: window registration is
//! collective, and one rank registering while another does not would hang the group. The copy engines only work
//! inside one node (the peers' memory is mapped over NVLink), so `auto` chooses them only when every rank shares
//! one node and every NCCL can.

use std::fmt;

/// The AllGather asked for (`run --allgather-engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllGatherEngine {
    /// The copy engines when every rank can use them on one node, else kernels.
    #[default]
    Auto,
    /// NCCL's copy-engine AllGather; an error when some rank cannot use it.
    CopyEngine,
    /// NCCL's kernel AllGather (SMs beside the compute).
    Kernel,
}

/// What one rank offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOffer {
    /// Identifies the rank's machine (its kernel boot id, else its host name): equal keys share a node.
    pub node: String,
    /// `None` when the rank's NCCL can run the copy-engine AllGather, else why not.
    pub unable: Option<String>,
}

/// Separates the fields of an encoded offer (never in a boot id or host name).
const SEP: char = '\n';

impl EngineOffer {
    /// The offer as bytes, for the rendezvous.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut s = self.node.replace(SEP, " ");
        s.push(SEP);
        if let Some(why) = &self.unable {
            s.push_str(why);
        }
        s.into_bytes()
    }

    /// The offer from [`EngineOffer::to_bytes`]'s bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<EngineOffer, OfferError> {
        let text = std::str::from_utf8(bytes).map_err(|_| OfferError::NotUtf8 { len: bytes.len() })?;
        let (node, why) = text.split_once(SEP).ok_or_else(|| OfferError::NoSeparator { text: text.to_string() })?;
        Ok(EngineOffer { node: node.to_string(), unable: (!why.is_empty()).then(|| why.to_string()) })
    }
}

/// Why bytes are not an [`EngineOffer`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OfferError {
    /// The bytes are not UTF-8.
    #[error("an AllGather engine offer of {len} bytes is not UTF-8")]
    NotUtf8 {
        /// Their length.
        len: usize,
    },
    /// The text has no field separator.
    #[error("malformed AllGather engine offer {text:?}")]
    NoSeparator {
        /// The text received.
        text: String,
    },
}

/// `copy-engine` was asked for and some rank cannot use it (or the ranks span nodes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--allgather-engine copy-engine: {why}; use --allgather-engine auto or kernel")]
pub struct CopyEngineRefused {
    /// What rules the copy engines out, naming the rank (`rank 1: NCCL 22703 is older than 2.28`).
    pub why: String,
}

/// What the ranks agreed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineChoice {
    /// Whether the copy-engine AllGather is used.
    pub copy_engine: bool,
    /// With `auto` and kernels chosen: why the copy engines were not.
    pub note: Option<String>,
}

impl fmt::Display for EngineChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.copy_engine { "copy-engine" } else { "kernel" })
    }
}

/// Decides from every rank's offer (rank order); every rank calls it with the same offers and gets the same
/// answer. Errors (only for an explicit `copy-engine`) name the rank and the way out.
pub fn choose_engine(requested: AllGatherEngine, offers: &[EngineOffer]) -> Result<EngineChoice, CopyEngineRefused> {
    if requested == AllGatherEngine::Kernel {
        return Ok(EngineChoice { copy_engine: false, note: None });
    }
    let unable = offers.iter().enumerate().find_map(|(r, o)| o.unable.as_ref().map(|why| format!("rank {r}: {why}")));
    let nodes = {
        let mut n: Vec<&str> = offers.iter().map(|o| o.node.as_str()).collect();
        n.sort_unstable();
        n.dedup();
        n.len()
    };
    let obstacle = match (unable, nodes) {
        (Some(why), _) => Some(why),
        (None, n) if n > 1 => {
            Some(format!("the ranks span {n} nodes, and the copy-engine AllGather works within one node"))
        }
        _ => None,
    };
    match (requested, obstacle) {
        (_, None) => Ok(EngineChoice { copy_engine: true, note: None }),
        (AllGatherEngine::CopyEngine, Some(why)) => Err(CopyEngineRefused { why }),
        (_, Some(why)) => Ok(EngineChoice { copy_engine: false, note: Some(why) }),
    }
}

/// This machine's node key: the kernel's boot id (shared by every process and container on one machine), else
/// the host name, else an empty key.
pub fn node_key() -> String {
    for path in ["/proc/sys/kernel/random/boot_id", "/proc/sys/kernel/hostname", "/etc/hostname"] {
        if let Ok(s) = std::fs::read_to_string(path) {
            let s = s.trim();
            if !s.is_empty() {
                return s.to_string();
            }
        }
    }
    String::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(node: &str, unable: Option<&str>) -> EngineOffer {
        EngineOffer { node: node.to_string(), unable: unable.map(str::to_string) }
    }

    #[test]
    fn offers_round_trip_through_bytes() {
        for o in [offer("a1b2", None), offer("host", Some("NCCL 22703 lacks ncclMemAlloc")), offer("", None)] {
            assert_eq!(EngineOffer::from_bytes(&o.to_bytes()).unwrap(), o);
        }
        assert_eq!(
            EngineOffer::from_bytes(b"no separator").unwrap_err().to_string(),
            "malformed AllGather engine offer \"no separator\""
        );
        assert_eq!(
            EngineOffer::from_bytes(&[0xff, b'\n']).unwrap_err().to_string(),
            "an AllGather engine offer of 2 bytes is not UTF-8"
        );
    }

    #[test]
    fn auto_takes_the_copy_engines_only_when_every_rank_can_on_one_node() {
        let ok = [offer("n", None), offer("n", None)];
        assert_eq!(choose_engine(AllGatherEngine::Auto, &ok), Ok(EngineChoice { copy_engine: true, note: None }));
        let old = [offer("n", None), offer("n", Some("NCCL 22703 is older than 2.28"))];
        assert_eq!(
            choose_engine(AllGatherEngine::Auto, &old),
            Ok(EngineChoice { copy_engine: false, note: Some("rank 1: NCCL 22703 is older than 2.28".into()) })
        );
        let two_nodes = [offer("n", None), offer("m", None), offer("n", None)];
        assert_eq!(
            choose_engine(AllGatherEngine::Auto, &two_nodes),
            Ok(EngineChoice {
                copy_engine: false,
                note: Some("the ranks span 2 nodes, and the copy-engine AllGather works within one node".into())
            })
        );
    }

    #[test]
    fn an_explicit_copy_engine_fails_with_the_reason_and_kernel_never_asks() {
        let old = [offer("n", Some("no symmetric memory")), offer("n", None)];
        assert_eq!(
            choose_engine(AllGatherEngine::CopyEngine, &old).unwrap_err().to_string(),
            "--allgather-engine copy-engine: rank 0: no symmetric memory; use --allgather-engine auto or kernel"
        );
        assert_eq!(
            choose_engine(AllGatherEngine::CopyEngine, &[offer("n", None), offer("n", None)]).map(|c| c.copy_engine),
            Ok(true)
        );
        assert_eq!(choose_engine(AllGatherEngine::Kernel, &old), Ok(EngineChoice { copy_engine: false, note: None }));
    }

    #[test]
    fn the_node_key_is_stable_within_a_process() {
        assert_eq!(node_key(), node_key());
    }
}
