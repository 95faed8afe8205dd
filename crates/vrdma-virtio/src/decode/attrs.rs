//! Address vectors and QP attributes, both ways: the driver's blocks into
//! the engine's attributes, and QUERY_QP's answer.

use vrdma_engine::{
    mr::Access,
    qp::{AhAttr, AttrMask, QpAttr, QpState},
};
use vrdma_face::Refused;
use vrdma_wire::{Gid, Psn, QKey, Qpn};

use crate::abi::{self};

/// An address vector, typed.
pub fn ah_attr(av: &abi::Av, port: u8) -> Result<AhAttr, Refused> {
    // A zero GID names no port (RoCEv2 has no address 0.0.0.0 or ::).
    if av.reserved.get() != 0 || av.dgid == [0; 16] {
        return Err(Refused::invalid("address vector"));
    }
    // §6.27: the device uses a flow label's low 20 bits and ignores the
    // rest, as hardware whose field is 20 bits does.
    Ok(AhAttr {
        dgid: Gid(av.dgid),
        flow_label: av.flow_label.get() & AhAttr::FLOW_LABEL_MASK,
        sgid_index: av.sgid_index,
        hop_limit: av.hop_limit,
        traffic_class: av.traffic_class,
        sl: av.sl,
        port_num: port,
        dmac: Some(av.dmac),
    })
}

/// The attributes a MODIFY_QP asks for: the masked fields from the
/// request, the rest from `cur` (the QP as it is). The engine then checks
/// the transition and the ranges.
pub fn qp_attr(cur: &QpAttr, mask: AttrMask, a: &abi::QpAttrs) -> Result<QpAttr, Refused> {
    let m = |bit: AttrMask| mask.contains(bit);
    let state = |v: u32| QpState::from_code(v).ok_or(Refused::invalid("QP state"));
    if a.sq_draining != 0 || a.reserved != 0 {
        return Err(Refused::invalid("reserved field"));
    }
    let port = if m(AttrMask::PORT) {
        a.port_num
    } else {
        cur.port_num
    };
    Ok(QpAttr {
        qp_state: if m(AttrMask::STATE) {
            state(a.qp_state.get())?
        } else {
            cur.qp_state
        },
        cur_qp_state: if m(AttrMask::CUR_STATE) {
            state(a.cur_qp_state.get())?
        } else {
            cur.qp_state
        },
        path_mtu: if m(AttrMask::PATH_MTU) {
            vrdma_engine::attr::Mtu::from_code(a.path_mtu.get())
                .ok_or(Refused::invalid("path MTU"))?
        } else {
            cur.path_mtu
        },
        qkey: if m(AttrMask::QKEY) {
            QKey(a.qkey.get())
        } else {
            cur.qkey
        },
        rq_psn: if m(AttrMask::RQ_PSN) {
            Psn::from_masked(a.rq_psn.get())
        } else {
            cur.rq_psn
        },
        sq_psn: if m(AttrMask::SQ_PSN) {
            Psn::from_masked(a.sq_psn.get())
        } else {
            cur.sq_psn
        },
        dest_qp_num: if m(AttrMask::DEST_QPN) {
            Qpn::try_from(a.dest_qp_num.get()).map_err(|_| Refused::invalid("destination QPN"))?
        } else {
            cur.dest_qp_num
        },
        qp_access_flags: if m(AttrMask::ACCESS_FLAGS) {
            let v = a.qp_access_flags.get();
            if v & !0xf != 0 {
                return Err(Refused::invalid("QP access flags"));
            }
            Access(v)
        } else {
            cur.qp_access_flags
        },
        cap: cur.cap,
        ah_attr: if m(AttrMask::AV) {
            ah_attr(&a.ah, port)?
        } else {
            cur.ah_attr
        },
        pkey_index: if m(AttrMask::PKEY_INDEX) {
            a.pkey_index.get()
        } else {
            cur.pkey_index
        },
        en_sqd_async_notify: if m(AttrMask::EN_SQD_ASYNC_NOTIFY) {
            a.en_sqd_async_notify != 0
        } else {
            cur.en_sqd_async_notify
        },
        sq_draining: false,
        max_rd_atomic: if m(AttrMask::MAX_QP_RD_ATOMIC) {
            a.max_rd_atomic
        } else {
            cur.max_rd_atomic
        },
        max_dest_rd_atomic: if m(AttrMask::MAX_DEST_RD_ATOMIC) {
            a.max_dest_rd_atomic
        } else {
            cur.max_dest_rd_atomic
        },
        min_rnr_timer: if m(AttrMask::MIN_RNR_TIMER) {
            a.min_rnr_timer
        } else {
            cur.min_rnr_timer
        },
        port_num: port,
        timeout: if m(AttrMask::TIMEOUT) {
            a.timeout
        } else {
            cur.timeout
        },
        retry_cnt: if m(AttrMask::RETRY_CNT) {
            a.retry_cnt
        } else {
            cur.retry_cnt
        },
        rnr_retry: if m(AttrMask::RNR_RETRY) {
            a.rnr_retry
        } else {
            cur.rnr_retry
        },
    })
}

/// The attribute block QUERY_QP returns.
pub fn qp_attrs(a: &QpAttr) -> abi::QpAttrs {
    abi::QpAttrs {
        qp_state: a.qp_state.code().into(),
        cur_qp_state: a.cur_qp_state.code().into(),
        path_mtu: (a.path_mtu as u32).into(),
        qkey: a.qkey.0.into(),
        rq_psn: a.rq_psn.value().into(),
        sq_psn: a.sq_psn.value().into(),
        dest_qp_num: a.dest_qp_num.value().into(),
        qp_access_flags: a.qp_access_flags.0.into(),
        pkey_index: a.pkey_index.into(),
        en_sqd_async_notify: u8::from(a.en_sqd_async_notify),
        sq_draining: u8::from(a.sq_draining),
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        reserved: 0,
        ah: abi::Av {
            dgid: a.ah_attr.dgid.0,
            flow_label: a.ah_attr.flow_label.into(),
            sgid_index: a.ah_attr.sgid_index,
            hop_limit: a.ah_attr.hop_limit,
            traffic_class: a.ah_attr.traffic_class,
            sl: a.ah_attr.sl,
            dmac: a.ah_attr.dmac.unwrap_or_default(),
            reserved: 0.into(),
        },
    }
}
