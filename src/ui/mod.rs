//! What the two terminal interfaces (`memfit tui`, `memfit watch`) share:
//! the terminal itself, in raw mode on the alternate screen for as long as
//! a [`Screen`] lives; the styles ([`style`]) and text helpers ([`text`])
//! they draw with; their widgets: a titled panel, a fill bar and the key
//! hints ([`widgets`]), the GPU rows ([`gpu`]) and the chart ([`chart`]).
//! Number formats are [`crate::units`]'.

pub mod chart;
pub mod gpu;
pub mod style;
pub mod text;
pub mod widgets;

use std::io::Stdout;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crossterm::execute;
use crossterm::terminal::{
    EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode,
};
use ratatui::Terminal;
use ratatui::backend::CrosstermBackend;

/// The terminal, taken over: raw mode, the alternate screen, a ratatui
/// `Terminal` to draw on. Dropping it gives the terminal back (on return,
/// on `?`, while unwinding); so does a panic on the thread that entered
/// it, before the panic's message is printed, so that the message is
/// readable. A panic on another thread leaves the screen to its owner.
pub struct Screen {
    pub terminal: Terminal<CrosstermBackend<Stdout>>,
    active: Arc<AtomicBool>,
}

impl Screen {
    /// Takes the terminal over; the error says why it cannot be used.
    pub fn enter() -> Result<Screen, String> {
        let active = Arc::new(AtomicBool::new(true));
        let (flag, owner) = (active.clone(), std::thread::current().id());
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().id() == owner && flag.swap(false, Ordering::SeqCst) {
                leave();
            }
            previous(info);
        }));
        let cannot = |e: std::io::Error| format!("cannot use this terminal: {e}");
        enable_raw_mode().map_err(cannot)?;
        let terminal = match Terminal::new(CrosstermBackend::new(std::io::stdout())) {
            Ok(t) => t,
            Err(e) => {
                active.store(false, Ordering::SeqCst);
                leave();
                return Err(cannot(e));
            }
        };
        // From here on, a failure gives the terminal back as `screen` drops.
        let mut screen = Screen { terminal, active };
        execute!(screen.terminal.backend_mut(), EnterAlternateScreen).map_err(cannot)?;
        Ok(screen)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        if self.active.swap(false, Ordering::SeqCst) {
            leave();
        }
    }
}

/// Raw mode off, the main screen back, the cursor shown.
fn leave() {
    let _ = disable_raw_mode();
    let _ = execute!(
        std::io::stdout(),
        LeaveAlternateScreen,
        crossterm::cursor::Show
    );
}

/// For unit tests that draw into a ratatui buffer.
#[cfg(test)]
pub mod testing {
    use ratatui::buffer::Buffer;

    /// The buffer's rows as text (a non-breaking space read as a space).
    pub fn rows(buf: &Buffer) -> Vec<String> {
        let a = buf.area;
        (a.y..a.y + a.height)
            .map(|y| {
                (a.x..a.x + a.width)
                    .map(|x| buf[(x, y)].symbol().replace('\u{a0}', " "))
                    .collect()
            })
            .collect()
    }
}
