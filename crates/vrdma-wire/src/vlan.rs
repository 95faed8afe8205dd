//! VLAN tags (IEEE 802.1Q) and the Ethernet II header that carries them:
//! none, one, or two stacked as 802.1ad QinQ (a service tag, then a
//! customer tag), as a capture on a host whose tenants' networks are VLANs
//! shows them.
//!
//! A tool path (`vrdma decode`, through [`crate::encap`]): the fabric and
//! the engine frame with [`crate::ethernet`], which knows one 802.1Q tag.
//!
//! On the wire a tag is a TPID in the EtherType position, then the 16-bit
//! TCI; the EtherType (or the next tag's TPID) follows. The view here,
//! [`Packet`], is over what follows a TPID: the TCI and that next EtherType
//! (IEEE 802.1Q-2018 §9.3, §9.6).

use core::fmt;

use crate::{
    Error, Header, Result, be,
    ethernet::{self, EtherType, MacAddr, VlanTag},
};

/// Length of a tag: TPID and TCI.
pub const TAG_LEN: usize = 4;
/// Tags an Ethernet header may carry here: QinQ's two. A third is refused
/// ([`Error::TooManyVlanTags`]).
pub const MAX_TAGS: usize = 2;

/// Where the first EtherType (or TPID) sits in an Ethernet header.
const ETHERTYPE_AT: usize = 12;

mod field {
    pub const TCI: usize = 0;
    pub const ETHERTYPE: usize = 2;
}

crate::fixed_view!(
    "A view over a VLAN tag after its TPID: the TCI, then the EtherType \
     (or TPID) of what follows.",
    Header::Vlan,
    TAG_LEN
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// Priority, drop eligibility and VLAN ID.
    pub fn tci(&self) -> VlanTag {
        VlanTag::from_tci(be::u16(self.buffer.as_ref(), field::TCI))
    }
    /// The EtherType after the tag: the payload's, or the next tag's TPID.
    pub fn ethertype(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::ETHERTYPE)
    }
    /// The bytes after the tag.
    pub fn payload(&self) -> &[u8] {
        self.buffer.as_ref().get(TAG_LEN..).unwrap_or(&[])
    }
}

/// The Tag Protocol Identifier: which kind of tag this is.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Tpid {
    /// 0x8100: a customer tag (C-tag), the tag of a single-tagged frame and
    /// the inner tag of QinQ.
    CTag,
    /// 0x88a8: a service tag (S-tag, IEEE 802.1ad), the outer tag of QinQ.
    STag,
}

impl Tpid {
    pub const fn value(self) -> u16 {
        match self {
            Tpid::CTag => 0x8100,
            Tpid::STag => 0x88a8,
        }
    }

    /// The TPID `v` names, if it is one.
    pub const fn from_value(v: u16) -> Option<Self> {
        match v {
            0x8100 => Some(Tpid::CTag),
            0x88a8 => Some(Tpid::STag),
            _ => None,
        }
    }
}

/// One VLAN tag: its kind and its control field.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Tag {
    pub tpid: Tpid,
    pub tci: VlanTag,
}

impl Tag {
    /// A customer tag with VLAN ID `vid` (priority 0).
    pub const fn ctag(vid: u16) -> Self {
        Self::new(Tpid::CTag, vid)
    }

    /// A service tag with VLAN ID `vid` (priority 0).
    pub const fn stag(vid: u16) -> Self {
        Self::new(Tpid::STag, vid)
    }

    const fn new(tpid: Tpid, vid: u16) -> Self {
        Self {
            tpid,
            tci: VlanTag {
                pcp: 0,
                dei: false,
                vid: vid & 0x0fff,
            },
        }
    }
}

/// The tags of one Ethernet header, outermost first: at most
/// [`MAX_TAGS`], held without allocation.
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct Tags {
    len: u8,
    /// `tags[len..]` stay at the placeholder, so that the derived equality
    /// and hash see only the tags present.
    tags: [Option<Tag>; MAX_TAGS],
}

impl Tags {
    /// No tags.
    pub const NONE: Self = Self {
        len: 0,
        tags: [None; MAX_TAGS],
    };

    /// `tags`, outermost first; more than [`MAX_TAGS`] is out of range.
    pub fn from_slice(tags: &[Tag]) -> Result<Self> {
        let mut s = Self::NONE;
        for &t in tags {
            s.push(t).map_err(|_| Error::OutOfRange {
                what: "a VLAN tag stack (at most 2 tags)",
                value: tags.len() as u64,
            })?;
        }
        Ok(s)
    }

    /// Appends an inner tag; `Err` (with the tag back) when full.
    fn push(&mut self, t: Tag) -> core::result::Result<(), Tag> {
        match self.tags.get_mut(usize::from(self.len)) {
            Some(slot) => {
                *slot = Some(t);
                self.len += 1;
                Ok(())
            }
            None => Err(t),
        }
    }

    pub const fn len(&self) -> usize {
        self.len as usize
    }

    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tags, outermost first.
    pub fn iter(&self) -> impl Iterator<Item = Tag> + '_ {
        self.tags.iter().flatten().copied()
    }

    /// The VLAN IDs, outermost first.
    pub fn vids(&self) -> impl Iterator<Item = u16> + '_ {
        self.iter().map(|t| t.tci.vid)
    }

    /// The tag nearest the payload: the customer VLAN of QinQ.
    pub fn innermost(&self) -> Option<Tag> {
        self.iter().last()
    }

    /// The tag when there is exactly one and it is an 802.1Q C-tag: what
    /// [`ethernet::Repr::vlan`] can hold.
    pub fn sole_ctag(&self) -> Option<VlanTag> {
        match (self.len, self.tags[0]) {
            (1, Some(t)) if t.tpid == Tpid::CTag => Some(t.tci),
            _ => None,
        }
    }
}

impl fmt::Debug for Tags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The meaning of an Ethernet II header with up to [`MAX_TAGS`] VLAN
/// tags, carrying IPv4 or IPv6.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct TaggedRepr {
    pub dst: MacAddr,
    pub src: MacAddr,
    pub tags: Tags,
    pub ethertype: EtherType,
}

impl TaggedRepr {
    /// Parses the header at the front of `frame`: the addresses, each tag
    /// (TPID 0x8100 or 0x88a8, in any order), then the payload's
    /// EtherType. Errors: [`Error::Truncated`] (`Ethernet` for the first 14
    /// bytes, `Vlan` for a tag and the EtherType after it, `needed`
    /// counted from the start of the frame), [`Error::TooManyVlanTags`],
    /// [`Error::UnsupportedEtherType`].
    pub fn parse(frame: &[u8]) -> Result<Self> {
        crate::need(Header::Ethernet, ethernet::HEADER_LEN, frame.len())?;
        let f = ethernet::Frame::new_unchecked(frame);
        let mut tags = Tags::NONE;
        let mut at = ETHERTYPE_AT;
        loop {
            // `at + 2` bytes are present: checked above for the first
            // EtherType, by the tag's check below for the others.
            let value = be::u16(frame, at);
            let Some(tpid) = Tpid::from_value(value) else {
                return Ok(Self {
                    dst: f.dst(),
                    src: f.src(),
                    tags,
                    ethertype: EtherType::from_value(value)?,
                });
            };
            if tags.len() == MAX_TAGS {
                return Err(Error::TooManyVlanTags {
                    max: MAX_TAGS,
                    tpid: value,
                    at,
                });
            }
            let end = at + 2 + TAG_LEN;
            crate::need(Header::Vlan, end, frame.len())?;
            let tag = Packet::new_checked(&frame[at + 2..end])?;
            // Not full: checked above.
            let _ = tags.push(Tag {
                tpid,
                tci: tag.tci(),
            });
            at += TAG_LEN;
        }
    }

    pub const fn buffer_len(&self) -> usize {
        ethernet::HEADER_LEN + TAG_LEN * self.tags.len()
    }

    /// Writes the header into the front of `d`.
    pub fn emit(&self, d: &mut [u8]) -> Result<()> {
        crate::need(Header::Ethernet, self.buffer_len(), d.len())?;
        d[..6].copy_from_slice(&self.dst.0);
        d[6..12].copy_from_slice(&self.src.0);
        let mut at = ETHERTYPE_AT;
        for t in self.tags.iter() {
            be::set_u16(d, at, t.tpid.value());
            be::set_u16(d, at + 2, t.tci.tci());
            at += TAG_LEN;
        }
        be::set_u16(d, at, self.ethertype.value());
        Ok(())
    }

    /// The header as [`ethernet::Repr`] holds it, if it can: no tag, or a
    /// sole 802.1Q tag.
    pub fn to_ethernet(&self) -> Option<ethernet::Repr> {
        let vlan = match self.tags.len() {
            0 => None,
            _ => Some(self.tags.sole_ctag()?),
        };
        Some(ethernet::Repr {
            dst: self.dst,
            src: self.src,
            vlan,
            ethertype: self.ethertype,
        })
    }
}

impl From<ethernet::Repr> for TaggedRepr {
    fn from(e: ethernet::Repr) -> Self {
        let mut tags = Tags::NONE;
        if let Some(tci) = e.vlan {
            // One tag always fits.
            let _ = tags.push(Tag {
                tpid: Tpid::CTag,
                tci,
            });
        }
        Self {
            dst: e.dst,
            src: e.src,
            tags,
            ethertype: e.ethertype,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Ethernet header of frame 1 of the rxe capture read_bw_64.pcap
    /// (52:54:00:47:91:02 → 52:54:00:47:91:01, IPv4), with an 802.1ad
    /// S-tag (PCP 5, VID 10) and an 802.1Q C-tag (DEI, VID 100) inserted.
    static QINQ_HEADER: [u8; 22] = [
        0x52, 0x54, 0x00, 0x47, 0x91, 0x01, 0x52, 0x54, 0x00, 0x47, 0x91, 0x02, 0x88, 0xa8, 0xa0,
        0x0a, 0x81, 0x00, 0x10, 0x64, 0x08, 0x00,
    ];

    fn qinq() -> TaggedRepr {
        TaggedRepr {
            dst: MacAddr([0x52, 0x54, 0x00, 0x47, 0x91, 0x01]),
            src: MacAddr([0x52, 0x54, 0x00, 0x47, 0x91, 0x02]),
            tags: Tags::from_slice(&[
                Tag {
                    tpid: Tpid::STag,
                    tci: VlanTag {
                        pcp: 5,
                        dei: false,
                        vid: 10,
                    },
                },
                Tag {
                    tpid: Tpid::CTag,
                    tci: VlanTag {
                        pcp: 0,
                        dei: true,
                        vid: 100,
                    },
                },
            ])
            .unwrap(),
            ethertype: EtherType::Ipv4,
        }
    }

    #[test]
    fn deconstruct_and_construct_qinq() {
        let r = TaggedRepr::parse(&QINQ_HEADER).unwrap();
        assert_eq!(r, qinq());
        assert_eq!(r.buffer_len(), 22);
        assert_eq!(r.tags.vids().collect::<Vec<_>>(), [10, 100]);
        assert_eq!(r.tags.innermost().map(|t| t.tci.vid), Some(100));
        assert_eq!(r.tags.sole_ctag(), None);
        assert_eq!(r.to_ethernet(), None);
        let mut b = [0; 22];
        r.emit(&mut b).unwrap();
        assert_eq!(b, QINQ_HEADER);
    }

    #[test]
    fn the_tag_view_reads_tci_and_next_ethertype() {
        let p = Packet::new_checked(&QINQ_HEADER[14..]).unwrap();
        assert_eq!(
            p.tci(),
            VlanTag {
                pcp: 5,
                dei: false,
                vid: 10
            }
        );
        assert_eq!(p.ethertype(), 0x8100);
        assert_eq!(p.payload(), &QINQ_HEADER[18..]);
        assert_eq!(
            Packet::new_checked(&QINQ_HEADER[14..17]),
            Err(Error::Truncated {
                header: Header::Vlan,
                needed: 4,
                available: 3
            })
        );
    }

    #[test]
    fn untagged_and_single_tagged_agree_with_the_ethernet_module() {
        let mut single = QINQ_HEADER[..12].to_vec();
        single.extend_from_slice(&QINQ_HEADER[16..]);
        let mut untagged = QINQ_HEADER[..12].to_vec();
        untagged.extend_from_slice(&QINQ_HEADER[20..]);
        for b in [single, untagged] {
            let e = ethernet::Repr::parse(&ethernet::Frame::new_unchecked(&b[..])).unwrap();
            let t = TaggedRepr::parse(&b).unwrap();
            assert_eq!(t.to_ethernet(), Some(e));
            assert_eq!(TaggedRepr::from(e), t);
            assert_eq!(t.buffer_len(), e.buffer_len());
        }
    }

    #[test]
    fn a_single_service_tag_is_not_an_ethernet_repr() {
        let mut b = QINQ_HEADER[..16].to_vec();
        b.extend_from_slice(&QINQ_HEADER[20..]);
        let t = TaggedRepr::parse(&b).unwrap();
        assert_eq!(
            t.tags.iter().map(|t| t.tpid).collect::<Vec<_>>(),
            [Tpid::STag]
        );
        assert_eq!(t.to_ethernet(), None);
    }

    #[test]
    fn a_third_tag_is_refused() {
        let mut b = QINQ_HEADER[..20].to_vec();
        b.extend_from_slice(&[0x81, 0x00, 0x00, 0x07, 0x08, 0x00]);
        assert_eq!(
            TaggedRepr::parse(&b),
            Err(Error::TooManyVlanTags {
                max: 2,
                tpid: 0x8100,
                at: 20
            })
        );
        assert_eq!(
            Tags::from_slice(&[Tag::ctag(1); 3]),
            Err(Error::OutOfRange {
                what: "a VLAN tag stack (at most 2 tags)",
                value: 3
            })
        );
    }

    #[test]
    fn every_truncation_is_a_precise_error() {
        for len in 0..QINQ_HEADER.len() {
            let err = TaggedRepr::parse(&QINQ_HEADER[..len]).unwrap_err();
            let want = match len {
                0..14 => Error::Truncated {
                    header: Header::Ethernet,
                    needed: 14,
                    available: len,
                },
                14..18 => Error::Truncated {
                    header: Header::Vlan,
                    needed: 18,
                    available: len,
                },
                _ => Error::Truncated {
                    header: Header::Vlan,
                    needed: 22,
                    available: len,
                },
            };
            assert_eq!(err, want, "cut at {len}");
        }
    }

    #[test]
    fn arp_behind_tags_is_rejected() {
        let mut b = QINQ_HEADER;
        b[20..].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(
            TaggedRepr::parse(&b),
            Err(Error::UnsupportedEtherType(0x0806))
        );
    }

    #[test]
    fn pre_standard_tpids_are_not_tags_and_any_vid_is_kept() {
        let mut b = QINQ_HEADER;
        b[12..14].copy_from_slice(&[0x91, 0x00]);
        assert_eq!(
            TaggedRepr::parse(&b),
            Err(Error::UnsupportedEtherType(0x9100))
        );
        // VID 0 (a priority tag) and the reserved 0xfff, as found.
        let mut b = QINQ_HEADER;
        b[14..16].copy_from_slice(&[0x00, 0x00]);
        b[18..20].copy_from_slice(&[0x0f, 0xff]);
        let r = TaggedRepr::parse(&b).unwrap();
        assert_eq!(r.tags.vids().collect::<Vec<_>>(), [0, 0xfff]);
    }

    #[test]
    fn emit_into_a_short_buffer_fails() {
        let mut b = [0; 21];
        assert_eq!(
            qinq().emit(&mut b),
            Err(Error::Truncated {
                header: Header::Ethernet,
                needed: 22,
                available: 21
            })
        );
    }
}
