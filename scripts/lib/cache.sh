# The machine-wide cache of what does not change between runs: the guest images (the rxe
# harness's Debian 12 image, the PVRDMA guest's, the virtio-rdma guest's Debian 13 image and its
# base, the middleware images), each beside the inputs it was made from. It lives outside every
# clone, as cargo's registry does, so a second clean clone on the same machine boots the images
# the first one built; what a run produces (logs, captures, results, guests' run folders) stays
# in the clone's target/. Sourced by the scripts that make or boot an image.
#
#   VRDMA_CACHE_DIR   the cache (default: /var/cache/vrdma for root, else
#                     ${XDG_CACHE_HOME:-~/.cache}/vrdma); every image script keeps its own
#                     directory in it and rebuilds only when an input changed
#   cache_locked DIR CMD...
#                     runs CMD holding DIR/.lock exclusively (flock), so that two clones, or
#                     two scripts of one run, never build into one directory at once; it waits
#                     (up to an hour, a build's longest) for a build under way to finish.
#                     The locks nest in one order only: middleware > virtio-guest >
#                     pvrdma-guest > the rxe harness's directories.

if [ -z "${VRDMA_CACHE_DIR:-}" ]; then
    if [ "$(id -u)" = 0 ]; then
        VRDMA_CACHE_DIR=/var/cache/vrdma
    else
        VRDMA_CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/vrdma"
    fi
fi
export VRDMA_CACHE_DIR

cache_locked() {
    local dir=$1
    shift
    mkdir -p "$dir" || return 1
    flock -w 3600 "$dir/.lock" "$@"
}
