//! Refusals that can be seen: every command, work request or address
//! vector a face refuses is counted by reason (`refused.<kind>.<rule>` in
//! `vrdma stat`) and logged — the device, the object, the opcode, the
//! field and value, the rule — at most [`LOG_PER_SECOND`] lines a second
//! per device, the rest summed in one line when the second is over. A
//! refusal that left only a bare count (a UCX address vector whose flow
//! label the device once refused) is then found in the daemon's log
//! within a second.
//!
//! The reasons are the faces' own static texts, so the counters are
//! bounded by the code, not by what a guest sends.

use std::collections::BTreeMap;

use vrdma_engine::wc::WcStatus;

/// Log lines a device writes about refusals per second at most.
pub const LOG_PER_SECOND: u32 = 20;

/// What was refused.
#[derive(Clone, Copy, Debug, Eq, Ord, PartialEq, PartialOrd)]
pub enum Kind {
    Command,
    SendWqe,
    RecvWqe,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Command => "command",
            Kind::SendWqe => "send_wqe",
            Kind::RecvWqe => "recv_wqe",
        }
    }
}

/// One refusal: where it happened and why.
#[derive(Clone, Copy, Debug)]
pub struct Refusal<'a> {
    pub kind: Kind,
    /// The rule the input broke (the counter's name).
    pub rule: &'static str,
    /// The command's or the WQE's opcode.
    pub opcode: u32,
    /// The object it named (QPN, handle), 0 for none.
    pub object: u32,
    /// The offending field and its value, when one is known.
    pub field: Option<(&'a str, u64)>,
    /// The errno or completion status it was answered with.
    pub answer: &'a str,
}

/// A WQE a face cannot take as it is (both faces' decoders say it the
/// same way): its wr_id, the status its completion carries, its opcode,
/// and why — the rule broken, the field and its value.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Malformed {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: u32,
    pub rule: &'static str,
    pub field: &'static str,
    pub value: u64,
}

/// What a refusal of a send WQE names the WQE by: the wr_id and the opcode
/// (the face's numbering) its header carries. Every face's decoder and the
/// core's resolution build their [`Malformed`] through it.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct WqeIdentity {
    pub wr_id: u64,
    pub opcode: u32,
}

impl WqeIdentity {
    /// Refuses the WQE: it completes with `status` because `field`, holding
    /// `value`, breaks `rule`.
    pub fn refuse<T>(
        self,
        status: WcStatus,
        rule: &'static str,
        field: &'static str,
        value: u64,
    ) -> Result<T, Malformed> {
        Err(Malformed {
            wr_id: self.wr_id,
            status,
            opcode: self.opcode,
            rule,
            field,
            value,
        })
    }

    /// Refuses the WQE for what its opcode asks: it completes with a local
    /// QP operation error and names the opcode as the field at fault.
    pub fn refuse_opcode<T>(self, rule: &'static str) -> Result<T, Malformed> {
        self.refuse(WcStatus::LocQpOpErr, rule, "opcode", self.opcode.into())
    }
}

/// A device's refusals: counts by reason and the log's rate limit.
#[derive(Debug, Default)]
pub struct Refusals {
    counts: BTreeMap<(Kind, &'static str), u64>,
    /// The second (of the device clock, ns) the log's allowance is for,
    /// what it used and what it left unsaid.
    second: u64,
    logged: u32,
    suppressed: u64,
}

impl Refusals {
    /// Counts `r` and logs it if this second's allowance is not spent
    /// (`now`: the device clock, ns; `device`: its name for the log).
    pub fn note(&mut self, now: u64, device: &str, r: &Refusal<'_>) {
        *self.counts.entry((r.kind, r.rule)).or_insert(0) += 1;
        let second = now / 1_000_000_000;
        if second != self.second {
            if self.suppressed > 0 {
                tracing::warn!(
                    device,
                    suppressed = self.suppressed,
                    "more refusals in the last second (vrdma stat counts each by reason)"
                );
            }
            self.second = second;
            self.logged = 0;
            self.suppressed = 0;
        }
        if self.logged >= LOG_PER_SECOND {
            self.suppressed += 1;
            return;
        }
        self.logged += 1;
        let (field, value) = r.field.unwrap_or(("", 0));
        tracing::warn!(
            device,
            what = r.kind.as_str(),
            object = r.object,
            opcode = r.opcode,
            field,
            value = format_args!("{value:#x}"),
            rule = r.rule,
            answer = r.answer,
            "refused"
        );
    }

    /// Notes malformed WQE `m` of `kind` (a send or a receive WQE) on
    /// object `object` (the QPN, or the SRQ's handle) of the device whose
    /// thread this is (`face` names it when the thread has no name), and
    /// gives back the wr_id and status its completion carries.
    pub fn note_wqe(
        &mut self,
        now: u64,
        face: &str,
        kind: Kind,
        object: u32,
        m: &Malformed,
    ) -> (u64, WcStatus) {
        let answer = format!("{:?}", m.status);
        let r = Refusal {
            kind,
            rule: m.rule,
            opcode: m.opcode,
            object,
            field: Some((m.field, m.value)),
            answer: &answer,
        };
        let thread = std::thread::current();
        self.note(now, thread.name().unwrap_or(face), &r);
        (m.wr_id, m.status)
    }

    /// The counters, `refused.<kind>.<rule>` (the rule's words joined by
    /// `_`), for `vrdma stat`.
    pub fn fields(&self) -> Vec<(String, u64)> {
        self.counts
            .iter()
            .map(|((k, rule), n)| (format!("refused.{}.{}", k.as_str(), slug(rule)), *n))
            .collect()
    }

    /// Refusals of `kind` for `rule` so far.
    pub fn count(&self, kind: Kind, rule: &str) -> u64 {
        self.counts
            .iter()
            .filter(|((k, r), _)| *k == kind && *r == rule)
            .map(|(_, n)| *n)
            .sum()
    }

    /// Refusals of `kind` so far, for every rule.
    pub fn total(&self, kind: Kind) -> u64 {
        self.counts
            .iter()
            .filter(|((k, _), _)| *k == kind)
            .map(|(_, n)| *n)
            .sum()
    }

    /// Log lines left unsaid in the current second.
    pub fn suppressed(&self) -> u64 {
        self.suppressed
    }
}

/// A rule's text as one word of a counter's name: letters and digits
/// kept, anything else one `_`.
fn slug(rule: &str) -> String {
    let mut s = String::with_capacity(rule.len());
    for c in rule.chars() {
        if c.is_ascii_alphanumeric() {
            s.push(c.to_ascii_lowercase());
        } else if !s.ends_with('_') {
            s.push('_');
        }
    }
    s.trim_matches('_').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(rule: &'static str) -> Refusal<'static> {
        Refusal {
            kind: Kind::SendWqe,
            rule,
            opcode: 0,
            object: 17,
            field: Some(("flow_label", 0xffff_ffff)),
            answer: "LOC_QP_OP_ERR",
        }
    }

    #[test]
    fn refusals_are_counted_by_reason_and_the_log_is_bounded() {
        let mut f = Refusals::default();
        for i in 0..100 {
            f.note(i, "dev", &r("address vector (reserved bits)"));
        }
        f.note(5, "dev", &r("opcode for the QP type"));
        assert_eq!(
            f.count(Kind::SendWqe, "address vector (reserved bits)"),
            100
        );
        assert_eq!(
            f.fields(),
            [
                (
                    "refused.send_wqe.address_vector_reserved_bits".to_owned(),
                    100
                ),
                ("refused.send_wqe.opcode_for_the_qp_type".to_owned(), 1),
            ]
        );
        // 101 in one second: 20 logged, the rest left for the summary.
        assert_eq!(f.suppressed(), 81);
        // The next second: the summary, and the allowance anew.
        f.note(1_000_000_001, "dev", &r("opcode for the QP type"));
        assert_eq!(f.suppressed(), 0);
    }
}
