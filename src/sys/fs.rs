//! File operations below std's: a FIFO opened for writing only when a
//! process reads it.

use std::fs::File;
use std::io;
use std::path::Path;

use rustix::fs::OFlags;

/// Opens the FIFO at `path` for writing without waiting for a reader:
/// `Ok(None)` when no process reads it (a non-blocking open then fails
/// with ENXIO), else the descriptor, made blocking again so that writes
/// wait for the reader as a regular file's would. The caller keeps this
/// very descriptor: closing it would hand the reader an end of file.
pub fn open_fifo_for_writing(path: &Path) -> io::Result<Option<File>> {
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(OFlags::NONBLOCK.bits() as i32)
        .open(path);
    match opened {
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NXIO.raw_os_error()) => Ok(None),
        Err(e) => Err(e),
        Ok(file) => {
            make_blocking(&file)?;
            Ok(Some(file))
        }
    }
}

/// Clears `O_NONBLOCK` on `file`'s descriptor.
pub fn make_blocking(file: &File) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(file)?;
    rustix::fs::fcntl_setfl(file, flags - OFlags::NONBLOCK)?;
    Ok(())
}
