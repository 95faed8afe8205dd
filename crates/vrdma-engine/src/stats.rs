//! The data path's counters: what it received, sent, dropped (by reason)
//! and retried.

/// Counters of what the data path dropped, by reason.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct Stats {
    pub rx_packets: u64,
    pub tx_packets: u64,
    /// Malformed after the ICRC (bad opcode sequence, bad lengths…).
    pub rx_malformed: u64,
    /// For a QPN that does not exist, or a QP of another type.
    pub rx_no_qp: u64,
    /// The QP's state does not accept packets.
    pub rx_bad_state: u64,
    /// RC/UC packets from an address other than the QP's peer, or to an
    /// address other than the QP's own (as rxe's `check_addr`): dropped
    /// unanswered, so a stranger who guesses a QPN and PSN can neither
    /// execute requests nor break the connection.
    pub rx_bad_addr: u64,
    /// P_Key or Q_Key mismatch.
    pub rx_bad_key: u64,
    /// UD or UC message with no receive WQE posted.
    pub rx_no_recv: u64,
    /// Duplicates (RC: answered again; UC: dropped).
    pub rx_duplicate: u64,
    /// Out of sequence (RC: NAKed; UC: dropped).
    pub rx_out_of_sequence: u64,
    /// UD and UC messages longer than the receive buffer (dropped; the
    /// receive is kept).
    pub rx_too_long: u64,
    /// RC request packets sent again (go-back-N after a loss).
    pub tx_retransmitted: u64,
    /// RC retries started by the local ACK timeout.
    pub retry_timeout: u64,
    /// RC retries started by a PSN sequence error NAK.
    pub retry_seq_nak: u64,
    /// RC retries started by an implied NAK (a later PSN answered while a
    /// READ or atomic response is missing).
    pub retry_implied_nak: u64,
    /// RC RNR NAKs received (each waits out its delay, then resends).
    pub rnr_naks: u64,
}

impl Stats {
    /// Every counter with its name, in declaration order (for `vrdma
    /// stat` and logs). Destructured so that a new counter cannot be
    /// left out.
    pub fn fields(&self) -> [(&'static str, u64); 16] {
        let Stats {
            rx_packets,
            tx_packets,
            rx_malformed,
            rx_no_qp,
            rx_bad_state,
            rx_bad_addr,
            rx_bad_key,
            rx_no_recv,
            rx_duplicate,
            rx_out_of_sequence,
            rx_too_long,
            tx_retransmitted,
            retry_timeout,
            retry_seq_nak,
            retry_implied_nak,
            rnr_naks,
        } = *self;
        [
            ("rx_packets", rx_packets),
            ("tx_packets", tx_packets),
            ("rx_malformed", rx_malformed),
            ("rx_no_qp", rx_no_qp),
            ("rx_bad_state", rx_bad_state),
            ("rx_bad_addr", rx_bad_addr),
            ("rx_bad_key", rx_bad_key),
            ("rx_no_recv", rx_no_recv),
            ("rx_duplicate", rx_duplicate),
            ("rx_out_of_sequence", rx_out_of_sequence),
            ("rx_too_long", rx_too_long),
            ("tx_retransmitted", tx_retransmitted),
            ("retry_timeout", retry_timeout),
            ("retry_seq_nak", retry_seq_nak),
            ("retry_implied_nak", retry_implied_nak),
            ("rnr_naks", rnr_naks),
        ]
    }
}
