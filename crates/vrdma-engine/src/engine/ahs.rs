//! Address handles, and the check every address vector passes (an AH's
//! or a connected QP's).

use super::{Engine, check_port};
use crate::{
    budget,
    error::{Kind, Result, VerbsError},
    handle::{AhHandle, PdHandle},
    objects::Ah,
    qp::AhAttr,
};

impl Engine {
    /// `ibv_create_ah`.
    pub fn create_ah(&mut self, pd: PdHandle, attr: AhAttr) -> Result<AhHandle> {
        self.pd(pd)?;
        self.check_av(&attr)?;
        let attr = attr.masked();
        let max = self.ahs.max();
        self.budget.charge(Kind::Ah, budget::ah())?;
        let Some((h, _)) = self.ahs.insert(Ah { pd, attr }) else {
            self.budget.release(budget::ah());
            return Err(VerbsError::Exhausted {
                kind: Kind::Ah,
                max,
            });
        };
        Ok(AhHandle(h))
    }

    /// `ibv_destroy_ah`.
    pub fn destroy_ah(&mut self, ah: AhHandle) -> Result<()> {
        self.ahs.remove(ah.0).ok_or(VerbsError::NotFound {
            kind: Kind::Ah,
            handle: ah.0,
        })?;
        self.budget.release(budget::ah());
        Ok(())
    }

    /// An address vector must name this port and a filled GID slot, and a
    /// destination GID (RoCE routes by GID). Its flow label is not checked:
    /// the field is 20 bits, and the bits above are dropped
    /// ([`AhAttr::masked`]) where the vector is kept.
    pub(super) fn check_av(&self, av: &AhAttr) -> Result<()> {
        check_port(av.port_num)?;
        if self.cx.port.gid(av.sgid_index).is_none() {
            return Err(VerbsError::Invalid {
                what: "source GID index",
            });
        }
        if av.dgid.0 == [0; 16] {
            return Err(VerbsError::Invalid {
                what: "destination GID (zero)",
            });
        }
        Ok(())
    }
}
